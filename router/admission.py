"""Admission control at the gateway: a request the target pool has no room for waits here, in arrival order, in a
bounded queue; beyond the bound it is refused at once (429, with Retry-After), before any worker sees it.

    refused = admission.refuse_on_arrival()         a full queue refuses any request, before its body is read
    ticket = await admission.acquire(num_blocks, priority)   FIFO (or priority) wait; AdmissionRefused when
                                                             refused or timed out
    ... dispatch, stream ...
    ticket.release()                                idempotent: room for the next request

Room is counted by this router, per request, from dispatch to the end of its stream:

    pool capacity  (the pool Generate calls go to: decode, or colocated; recomputed at every load poll)
        slots      = Σ over its healthy workers of max_num_seqs     requests one engine step can run
        kv_blocks  = Σ over its healthy workers of kv_blocks_total
    in flight      requests dispatched and not yet ended, and the KV blocks they need to start (prompt + 1)

    admitted when  in_flight < slots  and  in_flight_blocks + num_blocks <= kv_blocks
                   (a request alone is always admitted: whether it fits one worker is routing's question)
    expected wait  (requests ahead + 1) x (mean time a request holds its slot) / slots
    queued when    not admitted, the queue stays within max_queued_requests and kv_blocks queued blocks, and the
                   expected wait is within queue_timeout_s (a request that would time out is told so at once)
    refused (429)  otherwise ("queue_full"), Retry-After = the expected wait, in [1, 60] s
    timed out      a request still queued after queue_timeout_s leaves the queue: 503 with Retry-After
                   ("queue_timeout")
    cancelled      a client that disconnects while queued leaves the queue (its handler is cancelled)
    no worker      a pool with no healthy worker admits at once: routing answers 503, nothing to wait for
    unreported     a worker reporting no max_num_seqs or no KV size leaves that bound off (None: unbounded)
    disabled       `admission_control` False (`serve --no-admission-control`): every request is dispatched at once
                   and the engines queue it, as vLLM does
    by priority    the workers' --scheduling-policy priority (`by_priority`): the queue is kept in the order of
                   (priority, arrival), lower first, and a request goes at once only where it would head the queue;
                   its expected wait counts the requests queued ahead of it. A full queue makes room for a request
                   by refusing (429 "queue_full") the lowest-ranked waiters it strictly outranks, if that makes
                   room; else it is refused itself. A request's priority is in its body, so the early refusal
                   (`refuse_on_arrival`) refuses nothing.

Decisions are the pure functions below (`fits`, `may_queue`, `expected_wait_s`, `retry_after_s`); `Admission`
only keeps the queue and the counts. The counts are this router's own: several gateway replicas each admit up to
the full capacity (the engines then queue the excess themselves). The settings (`admission_control`,
`max_queued_requests`, `queue_timeout_s`) are the gateway's config, checked there (router/config.py).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.routing import WorkerLoad

if TYPE_CHECKING:
    from router.config import GatewayConfig

_MIN_RETRY_AFTER_S = 1
_MAX_RETRY_AFTER_S = 60
_HOLD_WEIGHT = 0.1  # each ended request moves the mean hold time a tenth of the way to its own


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """What the target pool can run at once; None: unbounded (a worker that does not report the figure)."""

    num_workers: int = 0
    slots: int | None = 0
    kv_blocks: int | None = 0

    @staticmethod
    def of(loads: Sequence[WorkerLoad], role: str) -> Capacity:
        pool = [load for load in loads if load.role == role and load.healthy]
        slots = None if any(load.max_num_seqs == 0 for load in pool) else sum(load.max_num_seqs for load in pool)
        blocks = None if any(load.kv_blocks_total == 0 for load in pool) else sum(load.kv_blocks_total for load in pool)
        return Capacity(num_workers=len(pool), slots=slots, kv_blocks=blocks)


@dataclass(frozen=True, kw_only=True)
class Usage:
    num_requests: int = 0
    num_blocks: int = 0


def fits(capacity: Capacity, in_flight: Usage, num_blocks: int) -> bool:
    """Whether a request of `num_blocks` may be dispatched now. With no worker in the pool it is (routing then
    answers 503 at once: there is nothing to wait for)."""
    if capacity.num_workers == 0 or in_flight.num_requests == 0:
        return True
    return (capacity.slots is None or in_flight.num_requests < capacity.slots) and (
        capacity.kv_blocks is None or in_flight.num_blocks + num_blocks <= capacity.kv_blocks)


def expected_wait_s(num_ahead: int, mean_hold_s: float, capacity: Capacity) -> float:
    """Seconds until `num_ahead` more requests have gone through the pool's slots, each holding one for
    `mean_hold_s`; 0 while nothing has been measured or the slots are unbounded."""
    if not capacity.slots or mean_hold_s <= 0:
        return 0.0
    return num_ahead * mean_hold_s / capacity.slots


def may_queue(capacity: Capacity, queued: Usage, num_blocks: int, *, max_queued_requests: int | None,
              wait_s: float = 0.0, queue_timeout_s: float = math.inf) -> bool:
    """Whether a request that does not fit now may wait. `max_queued_requests` None: the pool's slots (the queue
    holds at most one more pool's worth of running requests). `wait_s`: its expected wait."""
    limit = capacity.slots if max_queued_requests is None else max_queued_requests
    return (
        (limit is None or queued.num_requests < limit)
        and (capacity.kv_blocks is None or queued.num_blocks + num_blocks <= capacity.kv_blocks)
        and wait_s <= queue_timeout_s
    )


def retry_after_s(wait_s: float) -> int:
    """The Retry-After header for an expected wait: whole seconds within [1, 60]."""
    return max(_MIN_RETRY_AFTER_S, min(_MAX_RETRY_AFTER_S, math.ceil(wait_s)))


class AdmissionRefused(Exception):
    """Refused without dispatch. `reason`: "queue_full" (HTTP 429) or "queue_timeout" (HTTP 503)."""

    def __init__(self, reason: str, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def status_code(self) -> int:
        return 429 if self.reason == "queue_full" else 503


class Ticket:
    """One admitted request's share of the pool; `release()` once its stream has ended (idempotent)."""

    def __init__(self, admission: Admission | None, num_blocks: int, queued_s: float, admitted_s: float) -> None:
        self._admission = admission
        self.num_blocks = num_blocks
        self.queued_s = queued_s  # time spent waiting in the queue
        self.admitted_s = admitted_s
        self._released = admission is None

    def release(self) -> None:
        if not self._released:
            self._released = True
            assert self._admission is not None
            self._admission._release(self)


@dataclass(eq=False)
class _Waiter:
    num_blocks: int
    future: asyncio.Future[Ticket]
    enqueued_s: float
    priority: int = 0


class Admission:
    """The queue and the in-flight counts of one router, on its event loop, for the pool of `role` and with
    `config`'s admission settings; `by_priority`: the queue in priority order (see the module docstring).
    `update(loads)` after every load poll (capacity may have grown: the queue moves)."""

    def __init__(self, config: GatewayConfig, *, role: str, clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[str], None] | None = None,
                 on_admitted: Callable[[float], None] | None = None, by_priority: bool = False) -> None:
        self.config = config
        self.role = role
        self.by_priority = by_priority
        self._clock = clock
        self._on_refused = on_refused or (lambda reason: None)
        self._on_admitted = on_admitted or (lambda queued_s: None)
        self.capacity = Capacity()
        self.in_flight = Usage()
        self.mean_hold_s = 0.0  # how long an admitted request keeps its slot, on average (0: none ended yet)
        self._queue: deque[_Waiter] = deque()
        self._queued_blocks = 0

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def update(self, loads: Sequence[WorkerLoad]) -> None:
        self.capacity = Capacity.of(loads, self.role)
        self._drain()

    async def acquire(self, num_blocks: int, priority: int = 0) -> Ticket:
        """A ticket once the request may be dispatched; AdmissionRefused when it may not wait, waited past the
        queue timeout, or (by priority) lost its place to a higher priority. Cancelled (the client left): it leaves
        the queue."""
        if not self.config.admission_control:
            self._on_admitted(0.0)
            return Ticket(None, num_blocks, 0.0, self._clock())
        place = self._place(priority)
        if place == 0 and fits(self.capacity, self.in_flight, num_blocks):
            return self._admit(num_blocks, queued_s=0.0)
        refused, displaced = self._refusal(num_blocks, place=place, priority=priority)
        if refused is not None:
            self._on_refused(refused.reason)
            raise refused
        for lower in displaced:
            self._displace(lower)
        waiter = _Waiter(num_blocks, asyncio.get_running_loop().create_future(), self._clock(), priority)
        self._queue.insert(place, waiter)
        self._queued_blocks += num_blocks
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.config.queue_timeout_s)
        except TimeoutError:
            if waiter.future.done():  # admitted in the same instant: keep it
                return waiter.future.result()
            self._leave(waiter)
            self._on_refused("queue_timeout")
            raise AdmissionRefused(
                "queue_timeout", f"the request waited {self.config.queue_timeout_s:g} s for room without getting it",
                retry_after_s=retry_after_s(expected_wait_s(len(self._queue) + 1, self.mean_hold_s, self.capacity)),
            ) from None
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                waiter.future.result().release()  # admitted as the client left
            else:
                self._leave(waiter)
            raise

    def refuse_on_arrival(self) -> AdmissionRefused | None:
        """The refusal that `acquire` would give any request arriving now, whatever its size, else None: what a
        gateway may answer before it reads (parses, tokenizes) a request's body. A request of one block is the
        smallest, and the bounds only tighten with size, so one refused at one block is refused at any size. A
        refusal is counted as `acquire`'s are."""
        if (not self.config.admission_control or self.by_priority
                or (not self._queue and fits(self.capacity, self.in_flight, 1))):
            return None
        refused, _ = self._refusal(1, place=len(self._queue))
        if refused is not None:
            self._on_refused(refused.reason)
        return refused

    # -- internals -------------------------------------------------------------------------------------------
    def _place(self, priority: int) -> int:
        """Where a request of `priority` joins the queue: at the back, or by priority behind its equals."""
        if not self.by_priority:
            return len(self._queue)
        return bisect.bisect_right(self._queue, priority, key=lambda waiter: waiter.priority)

    def _refusal(self, num_blocks: int, *, place: int, priority: int = 0) -> tuple[AdmissionRefused | None,
                                                                                  list[_Waiter]]:
        """Why a request of `num_blocks` that does not fit now may not wait either (429), else None and the
        waiters it displaces to wait (by priority: the fewest lowest-ranked ones it outranks that make room).
        `place`: where it would join the queue."""
        queued = total = Usage(num_requests=len(self._queue), num_blocks=self._queued_blocks)
        wait_s = expected_wait_s(place + 1, self.mean_hold_s, self.capacity)
        displaced: list[_Waiter] = []
        lower = reversed(self._queue) if self.by_priority else iter(())
        while not may_queue(self.capacity, queued, num_blocks, max_queued_requests=self.config.max_queued_requests,
                            wait_s=wait_s, queue_timeout_s=self.config.queue_timeout_s):
            waiter = next(lower, None)
            if waiter is None or waiter.priority <= priority:
                return self._queue_full(total, wait_s), []
            displaced.append(waiter)
            queued = Usage(num_requests=queued.num_requests - 1, num_blocks=queued.num_blocks - waiter.num_blocks)
        return None, displaced

    def _queue_full(self, queued: Usage, wait_s: float) -> AdmissionRefused:
        return AdmissionRefused(
            "queue_full",
            f"the server is at capacity ({self.in_flight.num_requests} requests running, {queued.num_requests} "
            f"queued); retry later",
            retry_after_s=retry_after_s(wait_s),
        )

    def _admit(self, num_blocks: int, *, queued_s: float) -> Ticket:
        self.in_flight = Usage(num_requests=self.in_flight.num_requests + 1,
                               num_blocks=self.in_flight.num_blocks + num_blocks)
        self._on_admitted(queued_s)
        return Ticket(self, num_blocks, queued_s, self._clock())

    def _release(self, ticket: Ticket) -> None:
        self.in_flight = Usage(num_requests=self.in_flight.num_requests - 1,
                               num_blocks=self.in_flight.num_blocks - ticket.num_blocks)
        held_s = self._clock() - ticket.admitted_s
        self.mean_hold_s = held_s if self.mean_hold_s == 0 else self.mean_hold_s + _HOLD_WEIGHT * (
            held_s - self.mean_hold_s)
        self._drain()

    def _displace(self, waiter: _Waiter) -> None:
        """Refuse a queued request whose place a higher priority takes."""
        self._queue.remove(waiter)
        self._queued_blocks -= waiter.num_blocks
        self._on_refused("queue_full")
        waiter.future.set_exception(AdmissionRefused(
            "queue_full", "the queue is full and a request of higher priority took this one's place; retry later",
            retry_after_s=retry_after_s(expected_wait_s(len(self._queue), self.mean_hold_s, self.capacity))))

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
            self._queued_blocks -= waiter.num_blocks
            self._drain()  # a large request that left the head may unblock the smaller ones behind it

    def _drain(self) -> None:
        """Admit from the head, in order, while the head fits."""
        while self._queue and fits(self.capacity, self.in_flight, self._queue[0].num_blocks):
            waiter = self._queue.popleft()
            self._queued_blocks -= waiter.num_blocks
            waiter.future.set_result(self._admit(waiter.num_blocks, queued_s=self._clock() - waiter.enqueued_s))
