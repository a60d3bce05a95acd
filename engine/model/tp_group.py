"""A tensor-parallel group as the model's layers see it: this rank's place and the two collectives they need, timed.

The layer kinds of engine/model/parallel_layers.py call these; engine/distributed/group.py builds the process
group under them (gloo on CPU, NCCL on CUDA; on a CPU host the all-reduce and the gather go through shared memory,
engine/distributed/shm_collectives.py, the process group keeping the barrier and any CUDA tensor). `SINGLE` is the
group of one: its collectives are no-ops, so a TP-1 model runs the same code with no branch.

A collective waits at most its group's timeout; a peer that dies mid-collective fails it at once (its sockets
close, or rank 0's liveness check and abort end the shared-memory wait). Either way it raises, and the engine
reports the dead rank (engine/distributed/rank_group.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class CollectiveTimer:
    """Seconds spent in all-reduces since the last `reset` (what bench/tensor_parallel.py reports per layer)."""

    num_all_reduces: int = 0
    all_reduce_s: float = 0.0

    def reset(self) -> None:
        self.num_all_reduces, self.all_reduce_s = 0, 0.0


@dataclass
class TPGroup:
    rank: int
    size: int
    process_group: object | None = None  # a c10d ProcessGroup; None for the group of one
    # On CPU, the collectives go through shared memory instead (engine/distributed/shm_collectives.py), when set.
    shm: object | None = None
    timer: CollectiveTimer = field(default_factory=CollectiveTimer)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.size == 1:
            return tensor
        start_s = time.perf_counter()
        if self.shm is not None and tensor.device.type == "cpu":  # every rank takes it: none waits in gloo
            if tensor.is_contiguous():
                self.shm.all_reduce(tensor)  # type: ignore[attr-defined]
            else:
                tensor.copy_(self.shm.all_reduce(tensor.contiguous()))  # type: ignore[attr-defined]
        else:
            self.process_group.allreduce([tensor]).wait()  # type: ignore[union-attr]
        self.timer.all_reduce_s += time.perf_counter() - start_s
        self.timer.num_all_reduces += 1
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` (one shape on all ranks) concatenated along the last dimension, in rank order, on
        rank 0; None on the others."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.shm is not None and tensor.device.type == "cpu":
            parts = self.shm.gather(tensor)  # type: ignore[attr-defined]
            return None if parts is None else torch.cat(parts, dim=-1)
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self.process_group.gather([parts], [tensor], _gather_options()).wait()  # type: ignore[union-attr]
            return torch.cat(parts, dim=-1)
        self.process_group.gather([], [tensor], _gather_options()).wait()  # type: ignore[union-attr]
        return None

    def barrier(self) -> None:
        if self.size > 1:
            self.process_group.barrier().wait()  # type: ignore[union-attr]


SINGLE = TPGroup(rank=0, size=1)


def _gather_options() -> object:
    import torch.distributed as dist

    options = dist.GatherOptions()
    options.rootRank = 0
    return options
