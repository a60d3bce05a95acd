"""Staging buffers a transport reuses from handoff to handoff: pinned host memory, or device memory.

    pool = StagingPool(pinned_bytes)          or StagingPool(device_bytes(device))
    with pool.lease(num_bytes) as buffer:     a uint8 tensor of at least num_bytes, this handoff's alone
        ...                                   (every copy into or out of it complete before the block ends)

A buffer is allocated when no free one is large enough, and kept for the next handoff when the lease ends; so a
steady stream of handoffs of one size allocates once (pinned memory costs a cudaHostAlloc of milliseconds, device
memory may cost a cudaMalloc, and either may synchronise the device). A larger handoff than the kept buffers can
hold replaces the largest free one by one at least twice its size (up to `keep_bytes`), so growth stops after a few
steps; handoffs in flight at once each hold their own buffer; a handoff over `keep_bytes` gets a one-off buffer,
freed after it. At most `max_kept` free buffers stay (the smallest go first).

Thread-safe. The lease's holder must make sure nothing still reads or writes the buffer (an asynchronous copy)
before the lease ends: a released buffer is at once another handoff's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

KEEP_BYTES = 256 << 20  # buffers up to this size are kept for the next handoff
MAX_KEPT = 4  # free buffers kept
ROUND_BYTES = 1 << 20  # sizes are rounded up to this


def pinned_bytes(num_bytes: int) -> torch.Tensor:
    """`num_bytes` of page-locked host memory (a GPU copies to and from it asynchronously, at full speed)."""
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)


def device_bytes(device: torch.device) -> Callable[[int], torch.Tensor]:
    """An allocator of `num_bytes` on `device`."""
    return lambda num_bytes: torch.empty(num_bytes, dtype=torch.uint8, device=device)


class StagingPool:
    """Reusable uint8 buffers made by `allocate(num_bytes)`; see the module docstring."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], *, keep_bytes: int = KEEP_BYTES,
                 max_kept: int = MAX_KEPT) -> None:
        self._allocate = allocate
        self.keep_bytes = keep_bytes
        self.max_kept = max_kept
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self.num_allocated = 0  # buffers allocated so far, one-off ones included
        self.num_leased = 0  # leases not yet ended

    @contextmanager
    def lease(self, num_bytes: int) -> Iterator[torch.Tensor]:
        """A buffer of at least `num_bytes` (a uint8 tensor) until the block ends; see the module docstring."""
        buffer = self._take(num_bytes)
        try:
            yield buffer
        finally:
            self._give_back(buffer)

    def free_sizes(self) -> list[int]:
        """The sizes of the buffers kept free, smallest first."""
        with self._lock:
            return sorted(buffer.numel() for buffer in self._free)

    def clear(self) -> None:
        """Drop the free buffers (those leased go when their lease ends, as one-offs would)."""
        with self._lock:
            self._free.clear()

    def _take(self, num_bytes: int) -> torch.Tensor:
        with self._lock:
            self.num_leased += 1
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            size = _round_up(max(num_bytes, 1))
            if self._free and size <= self.keep_bytes:  # outgrown: the largest free one makes way for a larger one
                largest = self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].numel()))
                size = max(size, min(self.keep_bytes, 2 * largest.numel()))
            self.num_allocated += 1
        try:
            return self._allocate(size)
        except BaseException:
            with self._lock:
                self.num_leased -= 1
            raise

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.num_leased -= 1
            if buffer.numel() > self.keep_bytes:
                return
            self._free.append(buffer)
            if len(self._free) > self.max_kept:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


def _round_up(num_bytes: int) -> int:
    return -(-num_bytes // ROUND_BYTES) * ROUND_BYTES
