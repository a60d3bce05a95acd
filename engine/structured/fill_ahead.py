"""The grammar matchers' own thread: one bitmask fill at a time, started before the step's forward pass and waited
for by the sampler.

    engine thread   start(key, fill) ─▶ forward (device busy) ─▶ take(key) ─▶ sampler: wait ─▶ mask ─▶ sample
    fill thread                 └──▶ sync matchers, fill bitmask ──┘ (xgrammar's C++, GIL released)

Ownership: while a fill is in flight the matchers are the fill thread's. Every other use of them on the engine
thread first calls `drain`, which waits the fill out, so the two threads never touch a matcher at once; a fill
handed to the sampler by `take` stays tracked until it has finished, so that a step that fails before its sampler
waits (its requests then released) still drains it first.

Errors: a fill's exception reaches whoever waits on what `take` returned (the step, which fails its requests
through the engine's error path); a fill no step took is logged when drained.

Lifecycle: the thread is started on the first `start` and ends with `close`, or when this object is garbage
collected (the executor's worker holds only a weak reference to it), so it never outlives the engine that owns
it; an engine that never fills ahead never starts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from engine.structured.bitmask import PendingBitmask, TokenBitmask

logger = logging.getLogger(__name__)

THREAD_NAME = "grammar-fill"  # the thread's name starts with it (threading.enumerate() finds it)


class FillAhead:
    """At most one fill in flight; used from the engine thread only (the fills run on the thread it owns)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[TokenBitmask] | None = None  # the fill in flight or not yet waited out
        self._key: Hashable | None = None  # what it fills for, until `take` hands it over

    @property
    def tracking(self) -> bool:
        """Whether a fill is in flight or not yet waited out."""
        return self._future is not None

    def start(self, key: Hashable, fill: Callable[[], TokenBitmask]) -> None:
        """Run `fill` on the fill thread, for the step `key` names. A fill still tracked is drained first."""
        self.drain()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._future = self._executor.submit(fill)
        self._key = key

    def take(self, key: Hashable) -> PendingBitmask | None:
        """The fill started for `key`, handed over (still drained before the matchers' next use); None when no fill
        for `key` is tracked, after draining any other."""
        if self._future is None or self._key is None:
            return None
        if self._key != key:
            self.drain()
            return None
        self._key = None
        return PendingBitmask(self._future)

    def drain(self) -> None:
        """Wait for the tracked fill, if any, to finish, and forget it: the matchers are the engine thread's again."""
        future, untaken = self._future, self._key is not None
        self._future = self._key = None
        if future is None:
            return
        wait_futures([future])
        error = future.exception()
        if error is not None and untaken:
            logger.warning("a grammar bitmask fill that no step used failed: %r", error)

    def close(self) -> None:
        """Drain, then end the fill thread (a later `start` makes a new one)."""
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
