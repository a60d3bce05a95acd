"""One KV block as transports move it, read out of a paged cache and written back into one.

    unquantized   the cache's values view [num_layers, 2, block_size, Hkv, D], as it is (a strided view)
    fp8           the same view's bytes (uint8, same shape): a float8 tensor is not something every transport sends
    int8          one uint8 tensor of layout.block_bytes:  values' bytes ‖ scales' bytes
                    values  [num_layers, 2, block_size, Hkv, D] int8
                    scales  [num_layers, 2, Hkv]            float32

Transports see only a tensor of `layout.wire_shape` and `layout.wire_dtype`: they gather, checksum, split and
send it as any block, so the CRC-32C of an int8 block covers its scales. The sender packs an int8 block with one
copy (its values and scales live in two tensors of the cache); the receiver unpacks it straight into its cache,
verifying the checksum in the same pass (`copy_checked_parts`). Both sides copy bytes (uint8 views), so values and
scales arrive bit-exact, and no view needs a float32-aligned offset into a received message.

`read_wire_blocks` / `write_wire_blocks` move many blocks at once, one gather or scatter kernel for the lot (block
by block for int8, whose values and scales live apart): what a GPU transport needs, where each kernel launch from
Python costs more than copying a block. Their block ids go to the GPU from pinned memory, queued ahead of the
kernel that reads them: no host sync (`torch.tensor(ids, device=cuda)` waits for the device's queue to drain).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer.block_copy import copy_checked, copy_checked_parts
from kv_transfer.layout import DTYPE_SIZES, SCALE_DTYPE, KVLayout


def _scale_byte_shape(layout: KVLayout) -> tuple[int, int, int]:
    """A block's scales as bytes: [num_layers, 2, Hkv * 4]."""
    num_layers, kv, num_kv_heads = layout.scale_shape
    return (num_layers, kv, num_kv_heads * DTYPE_SIZES[SCALE_DTYPE])


def _check_scales(layout: KVLayout, scales: torch.Tensor | None) -> None:
    if layout.quantized != (scales is not None):
        raise ValueError(f"a {layout.kv_cache_dtype} KV block {'needs' if layout.quantized else 'has no'} scales")


def read_wire_block(layout: KVLayout, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The wire block of one cache block. `values`: its [num_layers, 2, block_size, Hkv, D] view of the cache;
    `scales`: its [num_layers, 2, Hkv] float32 view (int8), else None. Unquantized, `values` itself."""
    _check_scales(layout, scales)
    if scales is None:
        return values.view(torch.uint8) if layout.kv_cache_dtype == "fp8" else values
    out = torch.empty(layout.block_bytes, dtype=torch.uint8, device=values.device)
    out[: layout.value_bytes].view(layout.block_shape).copy_(values.view(torch.uint8))
    out[layout.value_bytes :].view(_scale_byte_shape(layout)).copy_(scales.view(torch.uint8))
    return out


def write_wire_block(layout: KVLayout, values: torch.Tensor, scales: torch.Tensor | None, data: torch.Tensor,
                     crc32c: int | None) -> None:
    """Copy wire block `data` into one cache block's `values` (and `scales`) views, raising KVChecksumError
    unless its bytes match `crc32c` (None: no check). See `copy_checked` for when the check comes."""
    _check_scales(layout, scales)
    if tuple(data.shape) != layout.wire_shape:
        raise ValueError(f"a wire block of shape {tuple(data.shape)}, expected {layout.wire_shape}")
    if scales is None:
        copy_checked(values.view(torch.uint8) if layout.kv_cache_dtype == "fp8" else values, data, crc32c)
        return
    copy_checked_parts(
        [
            (values.view(torch.uint8), data[: layout.value_bytes].view(layout.block_shape)),
            (scales.view(torch.uint8), data[layout.value_bytes :].view(_scale_byte_shape(layout))),
        ],
        crc32c,
    )


def _paged_wire_blocks(layout: KVLayout, kv_cache: torch.Tensor) -> torch.Tensor | None:
    """The paged cache [num_layers, 2, num_blocks, block_size, Hkv, D] as [num_blocks, *layout.wire_shape] of the
    wire dtype, a strided view; None for int8, whose blocks pack values and scales."""
    if layout.quantized:
        return None
    blocks = kv_cache.permute(2, 0, 1, 3, 4, 5)
    return blocks.view(torch.uint8) if layout.kv_cache_dtype == "fp8" else blocks


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """`block_ids` as an int64 tensor on `device`; on a GPU, an asynchronous copy from pinned memory (the caching
    host allocator keeps that memory until the copy is done)."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


def read_wire_blocks(layout: KVLayout, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                     block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Copy the wire blocks of cache blocks `block_ids` into `out` ([len(block_ids), *wire_shape], contiguous).
    `kv_scales`: the cache's [num_layers, 2, num_blocks, Hkv] scales (int8), else None."""
    paged = _paged_wire_blocks(layout, kv_cache)
    if paged is None:
        for slot, block_id in enumerate(block_ids):
            scales = None if kv_scales is None else kv_scales[:, :, block_id]
            out[slot].copy_(read_wire_block(layout, kv_cache[:, :, block_id], scales))
        return
    torch.index_select(paged, 0, block_index(block_ids, kv_cache.device), out=out)


def write_wire_blocks(layout: KVLayout, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                      block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Copy `data` ([len(block_ids), *wire_shape]) into cache blocks `block_ids`, unchecked: the caller verifies
    the bytes (a device digest of `data`) before the blocks may be read."""
    paged = _paged_wire_blocks(layout, kv_cache)
    if paged is None:
        for slot, block_id in enumerate(block_ids):
            scales = None if kv_scales is None else kv_scales[:, :, block_id]
            write_wire_block(layout, kv_cache[:, :, block_id], scales, data[slot], None)
        return
    paged.index_copy_(0, block_index(block_ids, kv_cache.device), data)
