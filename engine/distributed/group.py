"""Building a tensor-parallel group's process group: one per engine, straight from a store
(`torch.distributed.ProcessGroupGloo` / `ProcessGroupNCCL`), not through `init_process_group`: no process-wide
default group, so one process may hold several engines (tests do) and a group's failure stays its engine's. Gloo on
CPU, NCCL on CUDA (that path is untested on hardware here). The group the model's layers call is
engine/model/tp_group.py's `TPGroup`.

Every collective waits at most `timeout_s` (the store's and the group's timeout); a peer that dies mid-collective
fails it at once.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from engine.model.tp_group import TPGroup


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
        # Over loopback, named: the ranks share one machine, and gloo's default (the address the hostname resolves
        # to) may be an interface a container cannot reach itself on.
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timeout
        group = dist.ProcessGroupGloo(store, rank, world_size, options)
    return TPGroup(rank=rank, size=world_size, process_group=group)
