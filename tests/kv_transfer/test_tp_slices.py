"""Slices of a block's KV heads out of TP a ranks' caches into TP b ranks' caches: every receiver rank ends up with
exactly the TP 1 cache's heads it holds, bit for bit (values and int8 scales), in the blocks it reserved; a corrupt
slice fails its CRC-32C."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer.layout import KVChecksumError, KVLayout
from kv_transfer.tp_plan import TPHandoffPlan, plan_tp_handoff
from kv_transfer.tp_slices import RankCache

MODEL = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, block_size=2, dtype="float32")
NUM_BLOCKS = 5
SENDER_BLOCKS = [3, 0, 4]  # the handoff's blocks in the sender's cache ...
RECEIVER_BLOCKS = [1, 4, 2]  # ... and where the receiver reserved them


def _full_cache(layout: KVLayout, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A TP 1 cache of random bytes: [L, 2, blocks, block_size, Hkv, D] (and [L, 2, blocks, Hkv] int8 scales)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if layout.kv_cache_dtype == "int8":
        return (torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen),
                torch.rand(shape[:3] + shape[4:5], generator=gen))
    values = torch.randn(shape, generator=gen)
    if layout.kv_cache_dtype == "fp8":
        return values.to(torch.float8_e4m3fn), None
    return values.to(getattr(torch, layout.dtype)), None


def _shard(layout: KVLayout, values: torch.Tensor, scales: torch.Tensor | None) -> list[RankCache]:
    """Each rank's cache of `layout`, holding the full cache's heads of that rank."""
    ranks = []
    for rank in range(layout.tensor_parallel_size):
        heads = layout.kv_head_range(rank)
        ranks.append(RankCache(
            layout=layout, rank=rank,
            kv_cache=values[:, :, :, :, heads.start:heads.stop].contiguous(),
            kv_scales=None if scales is None else scales[:, :, :, heads.start:heads.stop].contiguous()))
    return ranks


def _move(plan: TPHandoffPlan, senders: list[RankCache], receivers: list[RankCache]) -> int:
    """Every slice of every handoff block, sender to receiver, checked; the bytes moved."""
    moved = 0
    for src_block, dst_block in zip(SENDER_BLOCKS, RECEIVER_BLOCKS, strict=True):
        for s in plan.slices:
            data, crc = senders[s.sender_rank].read_slice(src_block, s.sender_heads)
            assert data.is_contiguous() and data.numel() * data.element_size() == s.num_bytes
            receivers[s.receiver_rank].write_slice(dst_block, s.receiver_heads, data, crc)
            moved += s.num_bytes
    return moved


CASES = [(3, 1, 3), (3, 3, 1), (3, 3, 3), (3, 1, 1), (3, 3, 6), (3, 6, 1), (3, 6, 3),
         (8, 2, 4), (8, 4, 2), (8, 8, 16), (8, 16, 8), (8, 1, 8), (2, 4, 1)]


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("auto", "float32"), ("auto", "bfloat16"), ("int8", "float32"),
                                                  ("fp8", "bfloat16")])
def test_tp_a_to_tp_b_reassembles_the_tp1_heads_of_every_block(kv_cache_dtype: str, dtype: str) -> None:
    for num_kv_heads, a, b in CASES:
        model = dataclasses.replace(MODEL, num_kv_heads=num_kv_heads, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        sender = dataclasses.replace(model, tensor_parallel_size=a)
        receiver = dataclasses.replace(model, tensor_parallel_size=b)
        full_values, full_scales = _full_cache(model, seed=num_kv_heads * 100 + a * 10 + b)
        senders = _shard(sender, full_values, full_scales)
        receivers = _shard(receiver, torch.zeros_like(full_values),
                           None if full_scales is None else torch.zeros_like(full_scales))
        plan = plan_tp_handoff(sender, receiver)
        assert _move(plan, senders, receivers) == len(SENDER_BLOCKS) * plan.num_bytes_per_block
        for rank, got in enumerate(receivers):
            heads = receiver.kv_head_range(rank)
            for src_block, dst_block in zip(SENDER_BLOCKS, RECEIVER_BLOCKS, strict=True):
                want = full_values[:, :, src_block, :, heads.start:heads.stop]
                assert torch.equal(got.kv_cache[:, :, dst_block].view(torch.uint8), want.view(torch.uint8)), \
                    (num_kv_heads, a, b, rank, dst_block)
                if full_scales is not None:
                    assert got.kv_scales is not None
                    assert torch.equal(got.kv_scales[:, :, dst_block], full_scales[:, :, src_block,
                                                                                   heads.start:heads.stop])
            untouched = [blk for blk in range(NUM_BLOCKS) if blk not in RECEIVER_BLOCKS]
            assert not got.kv_cache[:, :, untouched].view(torch.uint8).any()  # no slice strayed outside its block


@pytest.mark.parametrize("kv_cache_dtype,corrupt_byte", [("auto", 0), ("int8", -1)])  # -1: an int8 slice's scale
def test_a_corrupt_slice_fails_its_checksum(kv_cache_dtype: str, corrupt_byte: int) -> None:
    model = dataclasses.replace(MODEL, num_kv_heads=8, kv_cache_dtype=kv_cache_dtype)
    sender, receiver = (dataclasses.replace(model, tensor_parallel_size=n) for n in (2, 4))
    full_values, full_scales = _full_cache(model, seed=7)
    senders = _shard(sender, full_values, full_scales)
    receivers = _shard(receiver, torch.zeros_like(full_values),
                       None if full_scales is None else torch.zeros_like(full_scales))
    s = plan_tp_handoff(sender, receiver).slices[1]
    data, crc = senders[s.sender_rank].read_slice(SENDER_BLOCKS[0], s.sender_heads)
    flat = data.view(-1).view(torch.uint8)
    flat[corrupt_byte % flat.numel()] ^= 0xFF
    with pytest.raises(KVChecksumError):
        receivers[s.receiver_rank].write_slice(RECEIVER_BLOCKS[0], s.receiver_heads, data, crc)


def test_a_cache_of_the_wrong_heads_is_refused() -> None:
    layout = dataclasses.replace(MODEL, num_kv_heads=8, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"expected \[2, 2, num_blocks, 2, 2, 4\]"):
        RankCache(layout=layout, rank=1, kv_cache=torch.zeros(2, 2, NUM_BLOCKS, 2, 4, 4))
    rank = RankCache(layout=layout, rank=1, kv_cache=torch.zeros(2, 2, NUM_BLOCKS, 2, 2, 4))
    with pytest.raises(ValueError, match="outside rank 1's 2"):
        rank.read_slice(0, range(1, 3))
