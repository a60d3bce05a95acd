"""Prompts the gateway sent to be prefilled and whose blocks no worker has published yet: the provisional holders the
prefix index cannot know of (a worker publishes a prompt's blocks once it has computed them, seconds later on CPU).

Peer fetch prices a fetch from the holders the index lists. A second request of a family that arrives while the
family's first is still being prefilled finds no holder; a load-based policy sends it to the other worker, which
computes the whole family again (docs/benchmarks.md, busy holder: 2 of 92 prompts of one run). This module lets
the dispatcher see the in-flight prefill instead, as SGLang's cache-aware router records a request's prefix at
dispatch time:

    entry = inflight.add(request_id, worker, incarnation, hashes, expected_s=, num_held=)     at dispatch (the
                               Generate call starts): the prompt's full blocks, the leading ones its worker held
                               already (cached or fetched) and how long its prefill is expected to take
    inflight.commit(entry)     its first message arrived: the worker has computed the blocks and holds them (its KV
                               events are on their way to the index); kept `confirm_ttl_s` more, for the lookups
                               that run before the index shows them, then dropped
    inflight.drop(entry)       the call failed or was cancelled: it holds nothing
    inflight.holder(hashes, exclude=worker_id)     the in-flight entry computing the longest leading run of
                               `hashes` (blocks past those its worker held; not `exclude`'s): `InflightHolder`, or
                               None
    inflight.matches(hashes, committed=True)       the committed entries holding leading runs of `hashes`
    await inflight.settled(entry, timeout_s)       until it is committed or dropped, at most `timeout_s` (never
                               hangs: a waiter's bound is what recomputing the blocks would cost)

Whether to wait is `wait_for_inflight` (pure): only when the in-flight prefill is expected to commit soon enough that
waiting for it and then fetching its blocks beats computing them now (router/peer_fetch.py's price, one cost model).
An entry lives at most `ttl_s` (a safety net against a call nobody settled); every add and lookup prunes expired
ones, so nothing accumulates; entries are kept by their first block's hash, so a lookup reads only the entries of
its own family. One gateway's memory only: a second replica sees the in-flight prefills it sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kv_transfer.block_hash import BlockHash
from router.peer_fetch import PeerFetchPlan

CONFIRM_TTL_S = 2.0  # a committed entry stands in for the index this long (events reach it within a step or two)
TTL_S = 600.0  # an entry nobody settled (a bug) goes after this long


@dataclass(eq=False, kw_only=True)
class InflightEntry:
    request_id: str
    worker_id: str
    incarnation: int
    block_hashes: tuple[BlockHash, ...]  # the prompt's full blocks the worker will hold once it has prefilled
    num_held: int  # its leading blocks the worker held at dispatch (cached or fetched): not computed, not waited for
    receivers: tuple[str, ...] = ()  # workers that get the blocks from it (the decode worker of a handoff)
    dispatched_s: float  # the clock's time at dispatch
    expected_commit_s: float  # when its prefill is expected to end (the clock's time)
    expires_s: float
    committed: bool = False
    _settled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def settled(self) -> bool:
        return self._settled.is_set()


@dataclass(frozen=True, kw_only=True)
class InflightHolder:
    entry: InflightEntry
    num_blocks: int  # leading blocks of the looked-up prompt it holds (or will)


class InflightPrefixes:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, confirm_ttl_s: float = CONFIRM_TTL_S,
                 ttl_s: float = TTL_S) -> None:
        self._clock = clock
        self._confirm_ttl_s = confirm_ttl_s
        self._ttl_s = ttl_s
        self._entries: dict[int, InflightEntry] = {}
        self._by_first: dict[BlockHash, dict[int, InflightEntry]] = {}  # the first block's hash -> its entries

    def now(self) -> float:
        """The clock entries are timed by."""
        return self._clock()

    def __len__(self) -> int:
        self._prune()
        return len(self._entries)

    def add(self, request_id: str, worker_id: str, incarnation: int, block_hashes: Sequence[BlockHash], *,
            expected_s: float, num_held: int = 0, receivers: Sequence[str] = ()) -> InflightEntry:
        """Record a prefill just dispatched to `worker_id`, expected to take `expected_s`, of a prompt whose
        first `num_held` blocks the worker held already."""
        self._prune()
        now = self._clock()
        entry = InflightEntry(request_id=request_id, worker_id=worker_id, incarnation=incarnation,
                              block_hashes=tuple(block_hashes), num_held=num_held, receivers=tuple(receivers),
                              dispatched_s=now,
                              expected_commit_s=now + max(expected_s, 0.0), expires_s=now + self._ttl_s)
        if entry.block_hashes:
            self._entries[id(entry)] = entry
            self._by_first.setdefault(entry.block_hashes[0], {})[id(entry)] = entry
        return entry

    def commit(self, entry: InflightEntry) -> None:
        """The prefill ended: the worker holds the blocks. Waiters wake; the entry stays `confirm_ttl_s`."""
        if entry.settled:
            return
        entry.committed = True
        entry.expires_s = min(entry.expires_s, self._clock() + self._confirm_ttl_s)
        entry._settled.set()

    def drop(self, entry: InflightEntry) -> None:
        """The call failed or was cancelled (idempotent; a committed entry is left to its short TTL)."""
        if not entry.settled:
            entry._settled.set()
            self._remove(entry)

    def holder(self, block_hashes: Sequence[BlockHash], *, exclude: str | None = None,
               committed: bool | None = None) -> InflightHolder | None:
        """The entry holding the longest leading run of `block_hashes`, not `exclude`'s; `committed` True or False
        keeps only committed or only in-flight entries. Ties: the earliest dispatched."""
        best: InflightHolder | None = None
        for found in self.matches(block_hashes, committed=committed):
            if found.entry.worker_id == exclude or found.num_blocks <= found.entry.num_held:
                continue  # nothing of this prompt is being computed there
            if best is None or found.num_blocks > best.num_blocks:
                best = found
        return best

    def matches(self, block_hashes: Sequence[BlockHash], *, committed: bool | None = None) -> list[InflightHolder]:
        """Every entry holding a leading run of `block_hashes` (in dispatch order)."""
        self._prune()
        out = []
        for entry in self._by_first.get(block_hashes[0], {}).values() if block_hashes else ():
            if committed is not None and entry.committed != committed:
                continue
            n = _leading_match(entry.block_hashes, block_hashes)
            if n > 0:
                out.append(InflightHolder(entry=entry, num_blocks=n))
        return out

    def confirmed(self, entry: InflightEntry) -> None:
        """The index lists what a committed entry holds: it is no longer needed."""
        if entry.committed:
            self._remove(entry)

    async def settled(self, entry: InflightEntry, timeout_s: float) -> bool:
        """Wait until `entry` is committed or dropped, at most `timeout_s`; True when it was committed."""
        if not entry.settled and timeout_s > 0:
            try:
                await asyncio.wait_for(entry._settled.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return entry.committed

    def _prune(self) -> None:
        now = self._clock()
        for entry in [e for e in self._entries.values() if e.expires_s <= now]:
            self._remove(entry)
            entry._settled.set()  # a waiter on an expired entry stops waiting

    def _remove(self, entry: InflightEntry) -> None:
        self._entries.pop(id(entry), None)
        family = self._by_first.get(entry.block_hashes[0]) if entry.block_hashes else None
        if family is not None:
            family.pop(id(entry), None)
            if not family:
                del self._by_first[entry.block_hashes[0]]


def _leading_match(held: Sequence[BlockHash], wanted: Sequence[BlockHash]) -> int:
    n = 0
    for a, b in zip(held, wanted):
        if a != b:
            break
        n += 1
    return n


def wait_for_inflight(plan: PeerFetchPlan | None, *, wait_s: float) -> float | None:
    """How long to wait for an in-flight prefill before fetching its blocks, or None to compute them now. `plan`:
    the priced fetch of those blocks from the in-flight worker as if it held them (`price_peer_fetch`), `wait_s`: how
    long until its prefill is expected to end. Wait only when waiting and then fetching is expected to beat
    computing, and never longer than computing would take less the fetch (the bound of a waiter)."""
    if plan is None or not plan.fetch or wait_s + plan.fetch_s >= plan.recompute_s:
        return None
    return plan.recompute_s - plan.fetch_s
