"""Run set-up work that uses torch on a thread that then exits, so that the engine loop's thread is the only one
left holding an OpenMP thread team.

Why: libgomp (the OpenMP runtime of torch's CPU wheel) gives every thread that runs a parallel region a team of
its own, kept for the thread's life, and once the process holds more OpenMP threads than it has CPUs it stops
spin-waiting between regions and sleeps instead. A worker that loaded its weights on one thread (Ray's actor
thread, or the main thread) and then steps its engine on another therefore ran every op ~4x slower at decode
sizes (48 -> 210 us for a 576x1536 GEMV and a softmax, 2 threads on 2 CPUs; single-stream decode through `serve`
at ~0.7x of the offline engine; docs/benchmarks.md). A team goes away with the thread that made it, so loading
on a short-lived thread leaves the loop thread's team the only one.

Threads that serve requests beside the engine (gRPC, the KV transports) run no parallel torch ops: their block
copies are the single-threaded C++ of kv_transfer/block_copy.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_on_fresh_thread(fn: Callable[[], T], *, name: str = "torch-setup") -> T:
    """`fn()` on a new thread, waited for; its result, or its exception re-raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
