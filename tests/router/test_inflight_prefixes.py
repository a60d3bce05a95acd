"""The gateway's in-flight prefills (router/inflight_prefixes.py): which one holds most of a prompt, waiting for one
(woken by its commit or its failure, bounded, never hanging), entries that go (no leak), and when waiting for one
beats computing its blocks. Pure: a fake clock, no I/O."""

from __future__ import annotations

import asyncio

import pytest

from kv_transfer.block_hash import BlockHashNamespace, hash_token_blocks
from router.inflight_prefixes import InflightPrefixes, wait_for_inflight
from router.peer_fetch import PeerFetchRates, price_peer_fetch
from router.routing import WorkerLoad

NS = BlockHashNamespace(model="sha256:inflight", block_size=4, kv_dtype="float32")
FAMILY = list(range(100, 140))  # 10 blocks
A = hash_token_blocks(NS, FAMILY + [1, 2, 3, 4])  # 11 blocks, the family's 10 first
B = hash_token_blocks(NS, FAMILY + [5, 6, 7, 8])
OTHER = hash_token_blocks(NS, list(range(500, 540)))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_the_entry_holding_the_longest_leading_run_of_another_workers() -> None:
    inflight = InflightPrefixes(clock=Clock())
    inflight.add("r1", "p0", 1, A[:5], expected_s=1.0)
    r2 = inflight.add("r2", "p1", 1, A, expected_s=1.0)
    inflight.add("r3", "p2", 1, OTHER, expected_s=1.0)
    found = inflight.holder(B)
    assert (found.entry, found.num_blocks) == (r2, 10)  # the family's blocks, not A's 11th
    found = inflight.holder(B, exclude="p1")
    assert (found.entry.request_id, found.num_blocks) == ("r1", 5)
    assert inflight.holder(B, exclude="p1", committed=True) is None
    assert inflight.holder(hash_token_blocks(NS, list(range(900, 940)))) is None


def test_a_waiter_wakes_on_commit_or_failure_and_never_waits_past_its_bound() -> None:
    async def scenario() -> tuple[bool, bool, bool, float]:
        inflight = InflightPrefixes()
        first, second, stuck = (inflight.add(f"r{i}", "p0", 1, A, expected_s=1.0) for i in range(3))
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, inflight.commit, first)
        loop.call_later(0.05, inflight.drop, second)
        committed = await asyncio.wait_for(inflight.settled(first, 30.0), 5.0)
        failed = await asyncio.wait_for(inflight.settled(second, 30.0), 5.0)
        started = loop.time()
        timed_out = await inflight.settled(stuck, 0.1)  # nobody settles it: the bound ends the wait
        return committed, failed, timed_out, loop.time() - started

    committed, failed, timed_out, waited_s = asyncio.run(scenario())
    assert (committed, failed, timed_out) == (True, False, False)
    assert waited_s < 5.0


def test_entries_go_once_committed_dropped_confirmed_or_expired() -> None:
    clock = Clock()
    inflight = InflightPrefixes(clock=clock, confirm_ttl_s=2.0, ttl_s=60.0)
    committed = inflight.add("r1", "p0", 1, A, expected_s=1.0)
    dropped = inflight.add("r2", "p1", 1, B, expected_s=1.0)
    confirmed = inflight.add("r3", "p2", 1, A, expected_s=1.0)
    forgotten = inflight.add("r4", "p3", 1, OTHER, expected_s=1.0)
    inflight.commit(committed)
    inflight.drop(dropped)
    inflight.commit(confirmed)
    inflight.confirmed(confirmed)
    assert len(inflight) == 2
    assert inflight.holder(A, committed=True).entry is committed  # a holder the index may not list yet
    clock.now += 2.0
    assert len(inflight) == 1  # the committed one, after its short TTL
    clock.now += 58.0
    assert len(inflight) == 0  # the one nobody settled, after the long one
    assert forgotten.settled  # whoever waited on it stops


BLOCK_BYTES = 368_640


def plan(num_blocks: int):  # noqa: ANN201
    """p1's fetch of `num_blocks` blocks from p0 at the priors: 0.74 ms a block against 8 ms computed."""
    p0, p1 = (WorkerLoad(worker_id=w, role="prefill", endpoint=f"{w}:1", healthy=True, kv_block_bytes=BLOCK_BYTES)
              for w in ("p0", "p1"))
    return price_peer_fetch({"p0": num_blocks}, p1, [p0], num_prompt_tokens=16 * 100, block_size=16,
                            rates=PeerFetchRates())


def test_wait_only_when_waiting_then_fetching_beats_computing() -> None:
    priced = plan(93)  # fetch 69 ms, recompute 744 ms
    assert wait_for_inflight(priced, wait_s=0.3) == pytest.approx(priced.recompute_s - priced.fetch_s)
    assert wait_for_inflight(priced, wait_s=-1.0) is not None  # overdue: it may end any moment, within the bound
    assert wait_for_inflight(priced, wait_s=0.7) is None  # 700 + 69 ms > 744 ms: compute now
    assert wait_for_inflight(None, wait_s=0.0) is None
    slow = PeerFetchRates()
    slow.observe_fetch("p0", "p1", BLOCK_BYTES, 1.0)  # a link slower than computing
    p0, p1 = (WorkerLoad(worker_id=w, role="prefill", endpoint=f"{w}:1", healthy=True, kv_block_bytes=BLOCK_BYTES)
              for w in ("p0", "p1"))
    slow_plan = price_peer_fetch({"p0": 93}, p1, [p0], num_prompt_tokens=1600, block_size=16, rates=slow)
    assert wait_for_inflight(slow_plan, wait_s=0.0) is None


def test_a_prefill_that_only_hits_what_its_worker_held_is_nothing_to_wait_for() -> None:
    """r1's worker held the family already (a prefix hit): it computes only A's 11th block, which B does not share;
    the family's blocks are the index's business (a holder now), not an in-flight prefill's."""
    inflight = InflightPrefixes(clock=Clock())
    inflight.add("r1", "p0", 1, A, expected_s=0.1, num_held=10)
    assert inflight.holder(B) is None
    assert inflight.holder(A).num_blocks == 11  # a prompt sharing the 11th block too: that one is being computed
    assert [m.num_blocks for m in inflight.matches(B)] == [10]
