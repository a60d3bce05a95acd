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

from dataclasses import dataclass

import torch

from kv_transfer.block_copy import gather
from kv_transfer.layout import KVLayout
from kv_transfer.tp_plan import slice_layout
from kv_transfer.wire_block import read_wire_block, write_wire_block


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
