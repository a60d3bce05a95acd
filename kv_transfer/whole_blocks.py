"""Whole blocks (every KV head, as a tensor-parallel size 1 engine holds them) read out of, and written into, a
tensor-parallel engine's rank caches, each rank's in place: what a tier below the device cache keeps, and what a peer
fetch stages, at any tensor-parallel size (engine/kv_tier_blocks.py, engine/kv_peer_blocks.py).

On cuda a child rank's cache is its device memory, mapped into rank 0 over CUDA IPC, and rank 0's copies come after
the step it last launched, which may still be running (async scheduling):
- `read` copies each head into a tensor on rank 0's device: PyTorch runs a cross-device copy after a two-way
  barrier with the destination device's stream, rank 0's. (The blocks it reads are cached ones, whose KV an earlier
  step computed.)
- `write` orders its copies after rank 0's stream first (`after_rank_0s_stream`, below), then
  synchronizes the devices it wrote before it returns: the child runs its next forward only after rank 0 sends it
  that step, so the forward sees the block.

No gRPC: the engine imports this (and kv_transfer/tp_slices.py, the handoffs' side, `after_rank_0s_stream`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.tp_plan import plan_tp_handoff


class WholeBlocks:
    """A whole block: values [num_layers, 2, block_size, num_kv_heads, head_dim] and, for int8, scales [num_layers, 2,
    num_kv_heads] float32. `read` takes each head from the lowest rank holding it; `write` puts each head into every
    rank holding it (both are the plans of a handoff to and from a TP 1 engine, kv_transfer/tp_plan.py). `ranks`:
    every rank's (kv_cache [num_layers, 2, num_blocks, block_size, local heads, head_dim], kv_scales or None), rank
    0 first (engine/kv_blocks.py `KVBlocks.ranks`)."""

    def __init__(self, layout: KVLayout, ranks: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        if len(ranks) != layout.tensor_parallel_size:
            raise ValueError(f"{len(ranks)} rank caches for tensor-parallel size {layout.tensor_parallel_size}")
        self.layout = layout
        self.ranks = ranks
        one = dataclasses.replace(layout, tensor_parallel_size=1)
        self._gather = plan_tp_handoff(layout, one).slices
        self._scatter = plan_tp_handoff(one, layout).slices
        first = ranks[0][0]
        self.kv_shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.kv_dtype = first.dtype
        self.device = first.device
        self._cuda_devices = sorted({cache.device for cache, _ in ranks if cache.is_cuda}, key=str)

    @property
    def nbytes(self) -> int:
        """One whole block's bytes: its values, and an int8 cache's scales."""
        num_layers, two, block_size, num_kv_heads, head_dim = self.kv_shape
        scales = num_layers * two * num_kv_heads * 4 if self.layout.quantized else 0
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return num_layers * two * block_size * num_kv_heads * head_dim * element + scales

    def read(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block `block_id`, every head, in new tensors on the caches' device."""
        kv = torch.empty(self.kv_shape, dtype=self.kv_dtype, device=self.device)
        scales = None if not self.layout.quantized else torch.empty(
            (*self.kv_shape[:2], self.kv_shape[3]), dtype=torch.float32, device=self.device)
        for s in self._gather:
            cache, cache_scales = self.ranks[s.sender_rank]
            kv[:, :, :, _run(s.receiver_heads)] = cache[:, :, block_id, :, _run(s.sender_heads)]
            if scales is not None:
                assert cache_scales is not None
                scales[:, :, _run(s.receiver_heads)] = cache_scales[:, :, block_id, _run(s.sender_heads)]
        return kv, scales

    def write(self, block_id: int, kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Store whole block `kv` (and its `scales`) as block `block_id` of every rank, each rank its heads."""
        after_rank_0s_stream(self.device, self._cuda_devices)
        for s in self._scatter:
            cache, cache_scales = self.ranks[s.receiver_rank]
            cache[:, :, block_id, :, _run(s.receiver_heads)] = kv[:, :, :, _run(s.sender_heads)]
            if scales is not None and cache_scales is not None:
                cache_scales[:, :, block_id, _run(s.receiver_heads)] = scales[:, :, _run(s.sender_heads)]
        for device in self._cuda_devices:  # written before a child's next step reads them (above)
            torch.cuda.synchronize(device)


def _run(heads: range) -> slice:
    return slice(heads.start, heads.stop)


def after_rank_0s_stream(first: torch.device, devices: Iterable[torch.device]) -> None:
    """Order rank 0's later copies into its children's caches (mapped over CUDA IPC, on `devices` other than its
    own, `first`) after the work rank 0's stream holds now. Under async scheduling that may be a step still running,
    whose children may still write blocks just freed and now reserved again (an aborted request's); the step's last
    collective comes after those writes in each child's stream, and rank 0's stream passes it only once every child
    has. On rank 0's own device the copies share its stream already (one stream a device in this engine). The KV
    handoffs rank 0 writes through the children's caches (inproc: kv_transfer/tp_slices.py) and `WholeBlocks` call
    it."""
    if first.type != "cuda":
        return
    for device in set(devices) - {first}:
        torch.cuda.current_stream(device).wait_stream(torch.cuda.current_stream(first))
