"""Priority among the handoff reservations that wait for KV blocks (--scheduling-policy priority). No torch.

A decode worker's reservation that finds the pool full asks again every few milliseconds until it gets its blocks
or gives up (decode_worker/worker.py). The asks race: blocks freed between two of them would go to whichever came
first, so a low-priority reservation could take them ahead of a higher one that has waited longer. This keeps the
priority of each reservation that was refused, and refuses one that a waiting reservation strictly outranks (a
lower priority value): the freed blocks wait for the higher one's next ask. Equal priorities race as before.

An entry lasts `ttl_s` past its last ask: a reservation whose worker gave up (its timeout, a cancelled request, a
lost connection) needs no call to leave and holds the lower ones back at most that long. One that gets its blocks
leaves at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

TTL_S = 1.0  # a hundred of the decode worker's polls: far longer than a lock held by a step's bookkeeping


class WaitingReservations:
    def __init__(self, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._waiting: dict[str, tuple[int, float]] = {}  # request id -> (priority, last ask)

    def attempt(self, request_id: str, priority: int, reserve: Callable[[], bool]) -> bool:
        """`reserve()` unless a waiting reservation outranks this one; whether it got its blocks (else it waits)."""
        if self.admits(request_id, priority) and reserve():
            self.granted(request_id)
            return True
        self.refused(request_id, priority)
        return False

    def admits(self, request_id: str, priority: int) -> bool:
        """Whether a reservation of `priority` may take blocks now: no other waiting one has a lower value."""
        now = self._clock()
        self._waiting = {rid: entry for rid, entry in self._waiting.items() if now - entry[1] <= self.ttl_s}
        return not any(other < priority for rid, (other, _) in self._waiting.items() if rid != request_id)

    def refused(self, request_id: str, priority: int) -> None:
        """The reservation got no blocks this time: it waits, and asks again."""
        self._waiting[request_id] = (priority, self._clock())

    def granted(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._waiting)
