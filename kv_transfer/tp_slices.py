"""A slice of a block's KV heads, read out of one tensor-parallel rank's paged cache and written into another's.

A rank of a TP engine holds its local KV heads of every block (kv_transfer/layout.py, `KVLayout.kv_head_range`):

    values  kv_cache   [num_layers, 2 (K, V), num_blocks, block_size, num_local_kv_heads, head_dim]
    scales  kv_scales  [num_layers, 2 (K, V), num_blocks, num_local_kv_heads] float32   (int8 only)

A slice (kv_transfer/tp_plan.py, `HeadSlice`) is a run of those local heads of one block. It travels as the wire
block of a model with only those heads (`tp_plan.slice_layout`: values, then scales for int8), so that the wire
block code (kv_transfer/wire_block.py) packs and unpacks it and one CRC-32C covers it, scales included. The
receiver's copy verifies the CRC as it copies (`copy_checked`): a mismatch raises KVChecksumError, after the write
when the copy is fused, so the caller must fail the handoff and free the blocks unread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_transfer.block_copy import gather
from kv_transfer.layout import KVHandoff, KVLayout, KVTransferError
from kv_transfer.tp_plan import WirePlan, slice_layout
from kv_transfer.whole_blocks import after_rank_0s_stream
from kv_transfer.wire_block import read_wire_block, read_wire_blocks, write_wire_block, write_wire_blocks


@dataclass(frozen=True, kw_only=True)
class RankCache:
    """Rank `rank`'s paged cache of an engine of `layout` (its `tensor_parallel_size` ranks): `kv_cache` holds the
    rank's `len(layout.kv_head_range(rank))` local heads; `kv_scales` is the int8 cache's scales, else None."""

    layout: KVLayout
    rank: int
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_local_kv_heads, head_dim]
    kv_scales: torch.Tensor | None = None  # [num_layers, 2, num_blocks, num_local_kv_heads] float32 (int8)

    def __post_init__(self) -> None:
        lay = self.layout
        num_local = len(lay.kv_head_range(self.rank))
        shape = tuple(self.kv_cache.shape)
        if (len(shape) != 6 or shape[:2] != (lay.num_layers, 2) or shape[3:] != (lay.block_size, num_local,
                                                                                  lay.head_dim)):
            raise ValueError(f"rank {self.rank} of {lay.tensor_parallel_size}: a KV cache of shape {shape}, expected "
                             f"[{lay.num_layers}, 2, num_blocks, {lay.block_size}, {num_local}, {lay.head_dim}]")
        if lay.quantized != (self.kv_scales is not None):
            raise ValueError(f"a {lay.kv_cache_dtype} KV cache {'needs' if lay.quantized else 'has no'} scales")
        if self.kv_scales is not None and tuple(self.kv_scales.shape) != (*shape[:3], num_local):
            raise ValueError(f"rank {self.rank}: KV scales of shape {tuple(self.kv_scales.shape)}, expected "
                             f"{(*shape[:3], num_local)}")

    @property
    def num_local_heads(self) -> int:
        return self.kv_cache.shape[4]

    def _views(self, block_id: int, local_heads: range) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not (0 <= local_heads.start < local_heads.stop <= self.num_local_heads and local_heads.step == 1):
            raise ValueError(f"local KV heads {local_heads} outside rank {self.rank}'s {self.num_local_heads}")
        values = self.kv_cache[:, :, block_id, :, local_heads.start:local_heads.stop]  # [L, 2, block_size, h, D]
        scales = None if self.kv_scales is None else self.kv_scales[:, :, block_id,
                                                                    local_heads.start:local_heads.stop]  # [L, 2, h]
        return values, scales

    def slice_view(self, block_id: int, local_heads: range) -> torch.Tensor:
        """Local heads `local_heads` of cache block `block_id` as a wire block of `slice_layout(layout,
        len(local_heads))`: a strided view of the cache (int8: values and scales packed in a copy), which a
        transport gathers as it copies it out."""
        values, scales = self._views(block_id, local_heads)
        return read_wire_block(slice_layout(self.layout, len(local_heads)), values, scales)

    def read_slice(self, block_id: int, local_heads: range) -> tuple[torch.Tensor, int]:
        """Local heads `local_heads` of cache block `block_id` as a contiguous wire block of
        `slice_layout(layout, len(local_heads))`, and its CRC-32C (gathered and checksummed in one pass on the CPU)."""
        values, scales = self._views(block_id, local_heads)
        return gather(read_wire_block(slice_layout(self.layout, len(local_heads)), values, scales))

    def write_slice(self, block_id: int, local_heads: range, data: torch.Tensor, crc32c: int | None) -> None:
        """Store wire slice `data` as local heads `local_heads` of cache block `block_id`, raising KVChecksumError
        unless its bytes match `crc32c` (None: unchecked); see the module docstring for when the check comes."""
        values, scales = self._views(block_id, local_heads)
        write_wire_block(slice_layout(self.layout, len(local_heads)), values, scales, data, crc32c)


def rank_caches(layout: KVLayout, ranks: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[RankCache, ...]:
    """A RankCache for each rank's (kv_cache, kv_scales), rank 0 first (engine/kv_blocks.py `KVBlocks.ranks`)."""
    if len(ranks) != layout.tensor_parallel_size:
        raise ValueError(f"{len(ranks)} rank caches for tensor-parallel size {layout.tensor_parallel_size}")
    return tuple(RankCache(layout=layout, rank=rank, kv_cache=kv_cache, kv_scales=kv_scales)
                 for rank, (kv_cache, kv_scales) in enumerate(ranks))


class WireBlocks:
    """A handoff's wire blocks (kv_transfer/tp_plan.py, `WirePlan`) in one engine's rank caches: handoff block `i`
    is cache block `block_ids[i]` on every rank; wire block `w` is the unit `plan.unit(w)` names, on the sender's
    side of it (`sender`, what a prefill worker reads) or the receiver's (what a decode worker writes).

    A plan of whole blocks on one rank (TP 1 → 1) reads and writes as before tensor parallelism, many blocks in one
    gather or scatter; any other moves slice by slice."""

    def __init__(self, caches: Sequence[RankCache], block_ids: Sequence[int], plan: WirePlan, *, sender: bool) -> None:
        self.caches = caches
        self.block_ids = block_ids
        self.plan = plan
        self.layout = plan.layout
        self.sender = sender
        only = caches[0]
        self._whole = (len(caches) == 1 and plan.units_per_block == 1
                       and plan.layout.num_kv_heads == only.num_local_heads)
        if not sender and caches[0] is not None:  # (None: a child rank's own lanes, in its own process)
            after_rank_0s_stream(caches[0].kv_cache.device, (c.kv_cache.device for c in caches[1:] if c is not None))

    def _unit(self, wire_index: int) -> tuple[RankCache, int, range]:
        block, unit = self.plan.unit(wire_index)
        if self.sender:
            return self.caches[unit.sender_rank], self.block_ids[block], unit.sender_heads
        return self.caches[unit.receiver_rank], self.block_ids[block], unit.receiver_heads

    def read_block(self, wire_index: int) -> torch.Tensor:
        cache, block_id, heads = self._unit(wire_index)
        return cache.slice_view(block_id, heads)

    def read_blocks(self, indices: range, out: torch.Tensor) -> None:
        if self._whole:
            only = self.caches[0]
            read_wire_blocks(self.layout, only.kv_cache, only.kv_scales, self.block_ids[indices.start:indices.stop],
                             out)
            return
        for slot, wire_index in enumerate(indices):
            out[slot].copy_(self.read_block(wire_index))

    def write_block(self, wire_index: int, data: torch.Tensor, crc32c: int | None) -> None:
        cache, block_id, heads = self._unit(wire_index)
        cache.write_slice(block_id, heads, data, crc32c)

    def write_blocks(self, first_index: int, data: torch.Tensor) -> None:
        if self._whole:
            only = self.caches[0]
            write_wire_blocks(self.layout, only.kv_cache, only.kv_scales,
                              self.block_ids[first_index:first_index + data.shape[0]], data)
            return
        for slot in range(data.shape[0]):
            self.write_block(first_index + slot, data[slot], None)


class LaneWrites:
    """A KVDestination for one lane of a handoff (kv_transfer/rank_lanes.py): its wire blocks into a rank's cache,
    each write made under `lock` only while `refusal()` says nothing and only at the lane's own wire indices, and its
    bytes counted. Rank 0's (kv_transfer/reservation.py) and a child's (kv_transfer/child_lanes.py) differ in the
    state they check and in how the lane commits and fails."""

    def __init__(self, handoff: KVHandoff, blocks: WireBlocks, lock: threading.Lock | threading.RLock) -> None:
        self.handoff = handoff
        self.lane = handoff.lane
        self.blocks = blocks
        self.lock = lock
        self.num_bytes = 0

    def refusal(self) -> str | None:
        """Why no block of this lane may be written now (called under `lock`); None while it receives."""
        raise NotImplementedError

    def _check(self, first: int, count: int) -> None:
        why = self.refusal()
        if why is not None:
            raise KVTransferError(why)
        indices = self.handoff.wire_indices
        if first not in indices or first + count - 1 not in indices:
            raise KVTransferError(f"lane {self.lane}: blocks {first} to {first + count - 1} are not its to write")

    def write_block(self, index: int, data: torch.Tensor, crc32c: int | None = None) -> None:
        with self.lock:
            self._check(index, 1)
            self.blocks.write_block(index, data, crc32c)
            self.num_bytes += data.numel() * data.element_size()

    def write_blocks(self, first_index: int, data: torch.Tensor) -> None:
        with self.lock:
            self._check(first_index, data.shape[0])
            self.blocks.write_blocks(first_index, data)
            self.num_bytes += data.numel() * data.element_size()
