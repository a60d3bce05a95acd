"""The requests a worker has taken in that its engine does not hold yet, counted for its load report.

    handler starts ──admissions.enter()──▶ Admission ──leave()──▶ inside the engine command that queues the
                                                                   request (or reserves its blocks), or on the
                                                                   handler's way out, whichever comes first

A request's queueing command waits for a step boundary, up to a whole prefill step. GetLoad does not: it reads the
engine's stats under the engine's lock while a step computes (`WorkerRuntime.load_stats`). It adds the requests
counted here to the engine's waiting ones. A request leaves this count inside its command, under that same lock, so
each load report counts it once, here or in the engine. Without this count, a request the router sent just before
its poll would be in neither.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
E = TypeVar("E")


class Admissions:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # enter/leave run on the asyncio loop, leave also on the engine thread
        self._count = 0

    @property
    def count(self) -> int:
        """Requests taken in and not yet in the engine (read under the engine's lock for a consistent report)."""
        return self._count

    def enter(self) -> Admission:
        with self._lock:
            self._count += 1
        return Admission(self)

    def _leave(self, admission: Admission) -> None:
        with self._lock:
            if not admission.left:
                admission.left = True
                self._count -= 1


class Admission:
    """One request's place in the count; `leave()` is idempotent and may race between threads."""

    __slots__ = ("_admissions", "left")

    def __init__(self, admissions: Admissions) -> None:
        self._admissions = admissions
        self.left = False

    def leave(self) -> None:
        self._admissions._leave(self)

    def then(self, fn: Callable[[E], T]) -> Callable[[E], T]:
        """`fn`, leaving the count first: for the engine command that queues the request (inside the command, so
        that no load report sees the request in both places or in neither)."""
        def run(engine: E) -> T:
            self.leave()
            return fn(engine)

        return run
