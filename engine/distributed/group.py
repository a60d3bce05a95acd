"""A tensor-parallel group: this rank's place in it and the two collectives the model needs, timed.

One group per engine, built straight from a store (`torch.distributed.ProcessGroupGloo` / `ProcessGroupNCCL`), not
through `init_process_group`: no process-wide default group, so one process may hold several engines (tests do)
and a group's failure stays its engine's. Gloo on CPU, NCCL on CUDA (that path is untested on hardware here).

Every collective waits at most `timeout_s` (the store's and the group's timeout); a peer that dies mid-collective
fails it at once (its sockets close). Either way the collective raises, and the engine reports the dead rank
(`rank_group.RankGroup.check`).

`SINGLE` is the group of one: its collectives are no-ops, so a TP-1 model runs the same code with no branch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

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
    timer: CollectiveTimer = field(default_factory=CollectiveTimer)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.size == 1:
            return tensor
        start_s = time.perf_counter()
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


def make_store(*, rank: int, world_size: int, port: int, timeout_s: float) -> object:
    """The group's rendezvous: rank 0 serves a TCPStore on a free loopback port (port 0) and the others join it.
    Ranks of one engine are on one machine, so loopback is all they need."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def make_group(store: object, *, rank: int, world_size: int, device: torch.device, timeout_s: float) -> TPGroup:
    """This rank's group over `store` (blocks until every rank has joined, or `timeout_s`)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":  # untested on hardware: NCCL refuses two ranks on one GPU
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group: object = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return TPGroup(rank=rank, size=world_size, process_group=group)
