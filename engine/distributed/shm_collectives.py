"""A CPU tensor-parallel group's all-reduce and gather through one shared-memory file, instead of gloo's sockets.

A CPU worker's ranks are processes on one host, and a decode step's all-reduces are small (a batch's rows of the
hidden size, two a layer). Over gloo each costs a few socket round trips and thread wake-ups: about 2 ms while the
ranks compute between them (bench/tensor_parallel.py measured a quarter of a TP-2 decode step in them). Here a rank
writes its part into its slot of a shared anonymous file, publishes a sequence number, and spins until every rank's
number has caught up; then each rank sums the slots itself, the same way, so every rank holds the same bits (vLLM
and SGLang do the same on CPU, in C++). Larger tensors (a long prefill's) go through in slot-sized pieces.

Layout: a 4 KiB header (rank r's sequence number on its own 64-byte line, then an abort word), then two sets of slots
(a slot per rank), used by alternate operations. An operation k writes the slots of parity k % 2 only once every
rank has published k - 1, i.e. finished reading operation k - 2's slots (a rank publishes k - 1 only after it has
read all of k - 2). Rank 0 publishes in a gather too (it writes nothing there), so that rule holds for gathers.

Ordering: a rank's slot bytes are stored before its sequence number, and read after a peer's number; x86-64's
memory model (stores not reordered with stores, loads not with loads) is what makes that safe without fences, so
`supported()` is x86-64 only, and elsewhere the group keeps gloo.

Waiting: a rank spins, then yields the core, then naps; when the group's ranks have more threads than the host has
cores (SmolLM2 at TP 3 on two), it naps almost at once, so that a waiting rank leaves the core to one computing.

Failure: a wait gives up after the group's timeout; rank 0 also asks its `peers_dead` (the RankGroup's liveness
check) every 20 ms, and `abort()` (rank 0's RankGroup, when it closes or fails) ends every rank's wait at once, so
a dead rank fails the step as promptly as a closed gloo socket did.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096
_LINE = 8  # int64 words per 64-byte line: rank r's sequence number is word r * _LINE
SLOT_BYTES = 2 << 20  # a batch of 256 rows of 2,048 float32 in one piece; more goes in pieces
_SPIN = 2000  # polls before a wait starts yielding the core
_YIELD_S = 0.002  # then sleep(0) (a yield) until this long, then 50 µs naps: ranks beyond the cores must get them
_SPIN_SHARED = 100  # with more ranks' threads than cores: a short spin, then naps at once (the core is another's)
_LIVENESS_S = 0.02
ENV = "SPLITSERVE_TP_CPU_COLLECTIVES"  # "shm" (default) or "gloo"


class CollectiveAborted(RuntimeError):
    """A shared-memory collective could not complete: a rank died, the group was closed, or it timed out."""


class GroupClosed(CollectiveAborted):
    """Rank 0 closed or failed the group (the abort word) during a collective; rank 0 reports why."""


def supported() -> bool:
    """Whether CPU groups use shared memory: on x86-64 Linux, unless $SPLITSERVE_TP_CPU_COLLECTIVES=gloo."""
    choice = os.environ.get(ENV, "shm").strip().lower() or "shm"
    if choice not in ("shm", "gloo"):
        raise ValueError(f"{ENV}={choice!r}: expected shm or gloo")
    return (choice == "shm" and platform.machine().lower() in ("x86_64", "amd64")
            and hasattr(os, "memfd_create") and hasattr(os, "posix_fallocate"))  # Linux


class SharedFile:
    """The group's memory: an anonymous file (memfd: no name in /dev/shm to leak, whatever kills rank 0, and not
    bound by a container's small /dev/shm). Rank 0 holds it open while it hands each child the descriptor itself
    over the child's pipe (engine/distributed/rank_group.py: SCM_RIGHTS, so no /proc access is needed). Once every
    rank has mapped it, `close` drops rank 0's descriptor; the mappings keep the memory until the last rank exits."""

    def __init__(self, world_size: int, slot_bytes: int) -> None:
        self.fd: int | None = os.memfd_create("splitserve-tp-collectives", os.MFD_CLOEXEC)
        try:  # reserved, not just sized: no memory for it is an error here, not a SIGBUS at the first write
            os.posix_fallocate(self.fd, 0, _file_bytes(world_size, slot_bytes))
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def create(world_size: int, slot_bytes: int = SLOT_BYTES) -> SharedFile | None:
    """A new zeroed file for a group of `world_size` (rank 0, before it starts the others), or None when there is
    no memory for it (the group then keeps gloo, with a warning)."""
    try:
        return SharedFile(world_size, slot_bytes)
    except OSError as exc:
        logger.warning("tensor-parallel collectives stay on gloo: no shared memory for them (%s)", exc)
        return None


def _file_bytes(world_size: int, slot_bytes: int) -> int:
    return HEADER_BYTES + 2 * world_size * slot_bytes


class ShmCollectives:
    def __init__(self, fd: int, *, rank: int, world_size: int, timeout_s: float,
                 slot_bytes: int = SLOT_BYTES) -> None:
        """`fd`: the group's SharedFile, this rank's descriptor of it (mapped here; the caller's to close)."""
        if (world_size + 1) * _LINE * 8 > HEADER_BYTES:
            raise ValueError(f"{world_size} ranks do not fit the shared-memory header")
        self.rank, self.world_size, self.timeout_s, self.slot_bytes = rank, world_size, timeout_s, slot_bytes
        self.peers_dead: Callable[[], str | None] | None = None  # rank 0's liveness check (set by its RankGroup)
        self._mm = mmap.mmap(fd, _file_bytes(world_size, slot_bytes))
        self._words = np.frombuffer(self._mm, dtype=np.int64, count=HEADER_BYTES // 8)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, count=2 * world_size * slot_bytes,
                                      offset=HEADER_BYTES)
        self._seq = 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        shared = world_size * torch.get_num_threads() > cores  # this rank's threads, as many a rank (the default)
        self._spin, self._yield_s = (_SPIN_SHARED, 0.0) if shared else (_SPIN, _YIELD_S)
        self._acc: torch.Tensor | None = None  # the float64 sums of groups of 3 or more

    def abort(self) -> None:
        """End every rank's current and later waits with CollectiveAborted (rank 0, as the group closes)."""
        self._words[self.world_size * _LINE] = 1

    # -- the two collectives ------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (contiguous, CPU) over the ranks in place; every rank gets the same bits. Over 3 or more ranks
        the parts are added in float64 and the sum rounded once, so it does not depend on the order of the ranks
        (a float32 sum of three does, by an ulp: enough to flip a Q8 activation's rounding in a GGUF model)."""
        flat = tensor.view(-1)
        for start, stop in self._pieces(flat):
            slots = self._begin(flat[start:stop])
            self._wait_all(self._seq)
            if len(slots) == 2:  # one addition: already the exact sum, rounded once
                torch.add(slots[0], slots[1], out=flat[start:stop])
                continue
            acc = self._float64(stop - start)
            acc.copy_(slots[0])
            for slot in slots[1:]:
                acc.add_(slot)
            flat[start:stop].copy_(acc)
        return tensor

    def _float64(self, numel: int) -> torch.Tensor:
        if self._acc is None or self._acc.numel() < numel:
            self._acc = torch.empty(max(numel, self.slot_bytes // 4), dtype=torch.float64)
        return self._acc[:numel]

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (one shape on every rank), in rank order, on rank 0; None on the others."""
        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else None
        for start, stop in self._pieces(flat):
            slots = self._begin(flat[start:stop])
            if parts is not None:
                self._wait_all(self._seq)
                for part, slot in zip(parts, slots, strict=True):
                    part[start:stop].copy_(slot)
        return None if parts is None else [part.view(tensor.shape) for part in parts]

    # -- the protocol ---------------------------------------------------------------------------------------------

    def _pieces(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        step = self.slot_bytes // flat.element_size()
        return [(start, min(start + step, flat.numel())) for start in range(0, flat.numel(), step)] or [(0, 0)]

    def _begin(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Start the next operation: wait until its slots are free, write `piece` into this rank's, publish. Returns
        every rank's slot of it, viewed as `piece`."""
        self._seq += 1
        seq = self._seq
        self._wait_all(seq - 1)
        nbytes = piece.numel() * piece.element_size()
        base = (seq % 2) * self.world_size * self.slot_bytes
        slots = [self._data[base + r * self.slot_bytes:base + r * self.slot_bytes + nbytes].view(piece.dtype)
                 for r in range(self.world_size)]
        slots[self.rank].copy_(piece)
        self._words[self.rank * _LINE] = seq
        return slots

    def _wait_all(self, seq: int) -> None:
        words, line, abort_at = self._words, _LINE, self.world_size * _LINE
        for r in range(self.world_size):
            if words[r * line] < seq:
                self._wait(r, seq, words, abort_at)

    def _wait(self, rank: int, seq: int, words: np.ndarray, abort_at: int) -> None:
        at = rank * _LINE
        for _ in range(self._spin):
            if words[at] >= seq:
                return
        start_s = time.monotonic()
        next_check_s = start_s + _LIVENESS_S
        while words[at] < seq:
            if words[abort_at]:
                raise GroupClosed("the tensor-parallel group was closed during a collective")
            now_s = time.monotonic()
            if now_s >= next_check_s:
                next_check_s = now_s + _LIVENESS_S
                dead = self.peers_dead() if self.peers_dead is not None else None
                if dead:
                    raise CollectiveAborted(f"a tensor-parallel rank is gone during a collective: {dead}")
                if now_s - start_s > self.timeout_s:
                    raise CollectiveAborted(f"tensor-parallel rank {rank} did not reach a collective within "
                                            f"{self.timeout_s:.0f} s")
            time.sleep(0 if now_s - start_s < self._yield_s else 50e-6)
