"""Building a tensor-parallel group's process group: one per engine, straight from a store
(`torch.distributed.ProcessGroupGloo` / `ProcessGroupNCCL`), not through `init_process_group`: no process-wide
default group, so one process may hold several engines (tests do) and a group's failure stays its engine's. Gloo on
CPU, NCCL on CUDA (that path is untested on hardware here: the GPU machines lent have one device, and NCCL refuses
two ranks on one GPU). On CUDA, rank r runs on the device r after rank 0's; `SPLITSERVE_TP_CUDA_BACKEND=gloo` puts
every rank on rank 0's device over gloo instead (slow: gloo copies each CUDA tensor through the host), which is how
the CUDA code path of a TP engine is checked on one GPU (tests/engine/distributed/test_tensor_parallel_cuda.py).
The group the model's layers call is engine/model/tp_group.py's `TPGroup`.

Every collective waits at most `timeout_s` (the store's and the group's timeout); a peer that dies mid-collective
fails it at once.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from engine.model.tp_group import TPGroup


CUDA_BACKEND_ENV = "SPLITSERVE_TP_CUDA_BACKEND"


def cuda_backend() -> str:
    """The collectives' backend on CUDA: nccl (default) or gloo ($SPLITSERVE_TP_CUDA_BACKEND)."""
    backend = os.environ.get(CUDA_BACKEND_ENV, "nccl").strip().lower() or "nccl"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{CUDA_BACKEND_ENV}={backend!r}: expected nccl or gloo")
    return backend


def rank_devices(device: torch.device, world_size: int, *, num_cuda_devices: int | None = None) -> list[torch.device]:
    """Each rank's device, rank 0 first. On cpu every rank's is cpu; on cuda rank r takes the device r after rank
    0's (a GPU per rank, as Ray gives a worker), or rank 0's own under gloo. ValueError when NCCL would be asked to
    put two ranks on one GPU (it refuses), naming how many devices there are."""
    if device.type != "cuda":
        return [device] * world_size
    first = device.index or 0
    if cuda_backend() == "gloo":
        return [torch.device("cuda", first)] * world_size
    count = torch.cuda.device_count() if num_cuda_devices is None else num_cuda_devices
    if first + world_size > count:
        raise ValueError(
            f"tensor_parallel_size {world_size} on cuda:{first} needs cuda:{first}..cuda:{first + world_size - 1}, "
            f"but {count} CUDA device(s) are visible (NCCL refuses two ranks on one GPU; "
            f"{CUDA_BACKEND_ENV}=gloo runs every rank on one device, slowly, for tests)")
    return [torch.device("cuda", first + rank) for rank in range(world_size)]


def make_store(*, rank: int, world_size: int, port: int, timeout_s: float) -> object:
    """The group's rendezvous: rank 0 serves a TCPStore on a free loopback port (port 0) and the others join it.
    Ranks of one engine are on one machine, so loopback is all they need."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def make_group(store: object, *, rank: int, world_size: int, device: torch.device, timeout_s: float,
               shm_fd: int | None = None) -> TPGroup:
    """This rank's group over `store` (blocks until every rank has joined, or `timeout_s`); on cpu with `shm_fd`
    (rank 0's shm_collectives.create, handed to every rank) its all-reduces and gathers go through that shared
    memory."""
    import torch.distributed as dist

    from engine.distributed.shm_collectives import ShmCollectives

    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda" and cuda_backend() == "nccl":  # untested on hardware (one GPU a machine here)
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
    shm = None
    if device.type == "cpu" and shm_fd is not None:
        shm = ShmCollectives(shm_fd, rank=rank, world_size=world_size, timeout_s=timeout_s)
    return TPGroup(rank=rank, size=world_size, process_group=group, shm=shm)
