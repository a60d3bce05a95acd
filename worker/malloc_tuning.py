"""glibc malloc settings for a worker process that moves KV blocks: big buffers reused, not mapped afresh.

Every KV block a worker receives over gRPC arrives in freshly allocated buffers (gRPC's slices, then the Python
`bytes` of the message), ~0.7 MiB each for SmolLM2. glibc serves allocations that large with mmap and returns
them with munmap, so each one page-faults on first touch: on the receiving side of a 46 MB handoff that was ~25 ms
of kernel time per handoff, half the transfer (bench/kv_transfer_throughput.py; docs/benchmarks.md). With a high
mmap threshold the buffers come from the heap, with a high trim threshold the heap keeps the freed pages, and
with one arena every thread (gRPC's pollers, handler threads, the engine loop) reuses the same free chunks.

The cost is memory that is not handed back to the OS between bursts (bounded by the peak of what was in use).

Applied with mallopt(3) when a worker starts, so it covers workers started by Ray as well as `python -m
*_worker`; `MALLOC_*` environment variables set before the process starts do the same for any other process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt(3) parameter numbers, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 256 << 20  # allocations below this come from the heap (glibc caps it at 32 MiB by default)
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap kept before memory is handed back
ARENA_MAX = 1

SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_ARENA_MAX, ARENA_MAX))

_applied = False


def tune_malloc() -> bool:
    """Apply the settings to this process (idempotent). False where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        logger.info("malloc tuning skipped: no mallopt in %s", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for param, value in SETTINGS:
        if mallopt(param, value) != 1:
            logger.warning("mallopt(%d, %d) failed", param, value)
            return False
    _applied = True
    return True
