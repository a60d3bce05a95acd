"""The engine's paged KV memory as a worker's KV handoff sees it: what a prefill worker reads and a decode worker
writes, block by block.

    kv_cache   [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: every layer in one tensor, so that
               kv_cache[:, :, block_id] (one block across all layers) moves in one strided copy
    kv_scales  [num_layers, 2, num_blocks, num_kv_heads] float32: an int8 cache's scales; None for any other
    layout     how a handoff names one of these blocks (kv_transfer/layout.py): the shape above without num_blocks,
               the model's dtype and the cache's

A view, not a copy: the runner's own tensors, which every forward pass reads and writes, for the engine's
lifetime. Which blocks a caller may touch is the control plane's to say: a held request's
(`LLMEngine.held_block_ids`, read-only until `release_held`) or a reservation's (`LLMEngine.reserve_remote`,
written before `commit_remote`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class KVBlocks:
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_scales: torch.Tensor | None  # int8 only: [num_layers, 2, num_blocks, num_kv_heads] float32
    layout: KVLayout
    # Every rank's (kv_cache, kv_scales), rank 0's (the two above) first: at tensor_parallel_size N each holds its
    # rank's KV heads (layout.kv_head_range) of every block id; ranks 1..N-1's are their processes' caches mapped
    # here (shared memory on cpu, CUDA IPC on a GPU). None where they are not mapped: only lanes reach them then
    # (kv_transfer/rank_lanes.py), neither a whole handoff nor a KV offload tier.
    ranks: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] | None = None

    def __post_init__(self) -> None:
        if self.ranks is None and self.layout.tensor_parallel_size == 1:
            object.__setattr__(self, "ranks", ((self.kv_cache, self.kv_scales),))

