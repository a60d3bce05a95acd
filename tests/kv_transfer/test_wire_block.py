"""An int8 block on the wire: packed out of the paged cache's values and scales, unpacked into another cache bit
for bit under one checksum; an unquantized block is the cache's view itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer.base import tensor_checksum
from kv_transfer.layout import KVChecksumError, KVLayout
from kv_transfer.wire_block import read_wire_block, read_wire_blocks, write_wire_block, write_wire_blocks

FLOAT32 = KVLayout(num_layers=3, num_kv_heads=3, head_dim=8, block_size=4, dtype="float32")
INT8 = dataclasses.replace(FLOAT32, kv_cache_dtype="int8")  # Hkv 3: the scales' byte runs are not 8-aligned


def _int8_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # [num_layers, 2, num_blocks, block_size, Hkv, D] int8 and [num_layers, 2, num_blocks, Hkv] float32, as the runner's
    values = torch.randint(-128, 128, (3, 2, 5, 4, 3, 8), dtype=torch.int8, generator=gen)
    scales = torch.rand((3, 2, 5, 3), generator=gen)
    return values, scales


def test_int8_block_packs_values_then_scales_and_unpacks_bit_exact() -> None:
    values, scales = _int8_cache(0)
    wire = read_wire_block(INT8, values[:, :, 2], scales[:, :, 2])
    assert wire.dtype == torch.uint8 and tuple(wire.shape) == INT8.wire_shape
    assert torch.equal(wire[: INT8.value_bytes], values[:, :, 2].contiguous().view(torch.uint8).view(-1))
    assert torch.equal(wire[INT8.value_bytes :], scales[:, :, 2].contiguous().view(torch.uint8).view(-1))

    # a received message's bytes at an odd offset: no float32 view of them is needed
    received = torch.frombuffer(bytearray(b"\0" + bytes(wire.numpy())), dtype=torch.uint8)[1:]
    dst_values, dst_scales = torch.zeros_like(values), torch.zeros_like(scales)
    write_wire_block(INT8, dst_values[:, :, 4], dst_scales[:, :, 4], received, tensor_checksum(wire))
    assert torch.equal(dst_values[:, :, 4], values[:, :, 2])
    assert torch.equal(dst_scales[:, :, 4].view(torch.int32), scales[:, :, 2].view(torch.int32))
    assert not dst_values[:, :, :4].any() and not dst_scales[:, :, :4].any()


def test_a_flipped_scale_byte_fails_the_check() -> None:
    values, scales = _int8_cache(1)
    wire = read_wire_block(INT8, values[:, :, 0], scales[:, :, 0])
    crc = tensor_checksum(wire)
    wire[-1] ^= 0x01
    with pytest.raises(KVChecksumError):
        write_wire_block(INT8, torch.zeros_like(values)[:, :, 0], torch.zeros_like(scales)[:, :, 0], wire, crc)


def test_unquantized_block_is_the_cache_view_and_scales_must_match_the_layout() -> None:
    cache = torch.randn(3, 2, 5, 4, 3, 8)
    assert read_wire_block(FLOAT32, cache[:, :, 1], None).data_ptr() == cache[:, :, 1].data_ptr()
    with pytest.raises(ValueError, match="needs scales"):
        read_wire_block(INT8, cache[:, :, 1].to(torch.int8), None)
    with pytest.raises(ValueError, match="has no scales"):
        read_wire_block(FLOAT32, cache[:, :, 1], torch.ones(3, 2, 3))
    with pytest.raises(ValueError, match="wire block of shape"):
        write_wire_block(INT8, torch.zeros(3, 2, 4, 3, 8, dtype=torch.int8), torch.zeros(3, 2, 3),
                         torch.zeros(INT8.block_bytes - 1, dtype=torch.uint8), None)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_many_blocks_at_once_equal_block_by_block(kv_cache_dtype: str) -> None:
    """`read_wire_blocks` / `write_wire_blocks` (one gather / scatter; block by block for int8) move the very bytes
    `read_wire_block` / `write_wire_block` move, to and from the named cache blocks only."""
    layout = dataclasses.replace(FLOAT32, kv_cache_dtype=kv_cache_dtype,
                                 dtype="bfloat16" if kv_cache_dtype == "fp8" else "float32")
    gen = torch.Generator().manual_seed(3)
    shape = (3, 2, 5, 4, 3, 8)  # [num_layers, 2, num_blocks, block_size, Hkv, D]
    if kv_cache_dtype == "int8":
        cache, scales = _int8_cache(2)
    else:
        cache = torch.randn(shape, generator=gen).to(torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32)
        scales = None
    block_ids = [4, 0, 2]
    out = torch.empty((len(block_ids), *layout.wire_shape), dtype=getattr(torch, layout.wire_dtype))
    read_wire_blocks(layout, cache, scales, block_ids, out)
    for slot, block_id in enumerate(block_ids):
        one = read_wire_block(layout, cache[:, :, block_id], None if scales is None else scales[:, :, block_id])
        assert torch.equal(out[slot].view(torch.uint8), one.contiguous().view(torch.uint8)), block_id

    dst = torch.zeros_like(cache)
    dst_scales = None if scales is None else torch.zeros_like(scales)
    write_wire_blocks(layout, dst, dst_scales, [1, 3, 4], out)
    for slot, (src_id, dst_id) in enumerate(zip(block_ids, [1, 3, 4])):
        assert torch.equal(dst[:, :, dst_id].view(torch.uint8), cache[:, :, src_id].view(torch.uint8)), dst_id
        if scales is not None:
            assert torch.equal(dst_scales[:, :, dst_id], scales[:, :, src_id])
    assert not dst[:, :, [0, 2]].view(torch.uint8).any()
