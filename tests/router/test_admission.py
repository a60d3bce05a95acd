"""router.admission: the pure decisions on numbers, then the queue's order, bounds, timeout and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import (
    Admission,
    AdmissionRefused,
    Capacity,
    Usage,
    expected_wait_s,
    fits,
    may_queue,
    retry_after_s,
)
from router.routing import WorkerLoad


def load(worker_id: str, *, role: str = "decode", healthy: bool = True, max_num_seqs: int = 4,
         kv_blocks_total: int = 10) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, endpoint=f"{worker_id}:1", healthy=healthy,
                      max_num_seqs=max_num_seqs, kv_blocks_total=kv_blocks_total, kv_blocks_free=kv_blocks_total)


# -- pure decisions ------------------------------------------------------------------------------------------
def test_capacity_sums_the_healthy_workers_of_the_pool() -> None:
    loads = [load("d0"), load("d1", max_num_seqs=2, kv_blocks_total=6), load("d2", healthy=False),
             load("p0", role="prefill", max_num_seqs=100)]
    assert Capacity.of(loads, "decode") == Capacity(num_workers=2, slots=6, kv_blocks=16)
    assert Capacity.of(loads, "colocated") == Capacity(num_workers=0, slots=0, kv_blocks=0)
    unreported = [load("d0"), load("d1", max_num_seqs=0, kv_blocks_total=0)]
    assert Capacity.of(unreported, "decode") == Capacity(num_workers=2, slots=None, kv_blocks=None)


def test_fits_by_slots_and_by_blocks() -> None:
    capacity = Capacity(num_workers=1, slots=2, kv_blocks=10)
    assert fits(capacity, Usage(num_requests=1, num_blocks=6), 4)
    assert not fits(capacity, Usage(num_requests=1, num_blocks=7), 4)  # 11 blocks > 10
    assert not fits(capacity, Usage(num_requests=2, num_blocks=2), 1)  # no slot
    assert fits(capacity, Usage(), 50)  # alone: always (routing says whether one worker can hold it)
    assert fits(Capacity(), Usage(num_requests=9), 1)  # no worker: dispatch, routing answers 503
    assert fits(Capacity(num_workers=1, slots=None, kv_blocks=None), Usage(num_requests=999, num_blocks=999), 9)


def test_may_queue_by_requests_and_blocks() -> None:
    capacity = Capacity(num_workers=1, slots=3, kv_blocks=10)
    assert may_queue(capacity, Usage(num_requests=2, num_blocks=4), 6, max_queued_requests=None)
    assert not may_queue(capacity, Usage(num_requests=3, num_blocks=0), 1, max_queued_requests=None)  # = slots
    assert not may_queue(capacity, Usage(num_requests=0, num_blocks=5), 6, max_queued_requests=None)  # 11 > 10
    assert may_queue(capacity, Usage(num_requests=7, num_blocks=0), 1, max_queued_requests=8)
    assert not may_queue(capacity, Usage(), 1, max_queued_requests=0)


def test_a_request_that_would_time_out_in_the_queue_is_refused_at_once() -> None:
    capacity = Capacity(num_workers=1, slots=4, kv_blocks=100)
    assert expected_wait_s(8, 2.0, capacity) == 4.0  # 8 ahead through 4 slots, 2 s each
    assert expected_wait_s(8, 0.0, capacity) == 0.0  # nothing measured yet
    assert expected_wait_s(8, 2.0, Capacity(num_workers=1, slots=None, kv_blocks=None)) == 0.0
    assert may_queue(capacity, Usage(), 1, max_queued_requests=None, wait_s=4.0, queue_timeout_s=5.0)
    assert not may_queue(capacity, Usage(), 1, max_queued_requests=None, wait_s=6.0, queue_timeout_s=5.0)


def test_retry_after_is_the_expected_wait_within_bounds() -> None:
    assert retry_after_s(2.0) == 2
    assert retry_after_s(2.1) == 3
    assert retry_after_s(0.0) == 1
    assert retry_after_s(1e6) == 60


# -- the queue -----------------------------------------------------------------------------------------------
def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def admission(**kwargs: object) -> Admission:
    a = Admission(role="decode", **kwargs)  # type: ignore[arg-type]
    a.update([load("d0", max_num_seqs=2, kv_blocks_total=10)])
    return a


def test_requests_wait_in_arrival_order_and_move_as_others_end() -> None:
    async def scenario() -> None:
        a = admission()
        first, second = await a.acquire(2), await a.acquire(2)
        assert a.in_flight == Usage(num_requests=2, num_blocks=4)
        order: list[str] = []

        async def wait(name: str, num_blocks: int) -> None:
            ticket = await a.acquire(num_blocks)
            order.append(name)
            assert ticket.queued_s > 0

        waiting = [asyncio.create_task(wait(name, 1)) for name in ("c", "d")]
        await asyncio.sleep(0.01)
        assert a.num_queued == 2 and order == []
        first.release()
        first.release()  # idempotent
        await asyncio.sleep(0.01)
        assert order == ["c"]
        second.release()
        await asyncio.gather(*waiting)
        assert order == ["c", "d"] and a.num_queued == 0
        assert a.in_flight == Usage(num_requests=2, num_blocks=2)

    run(scenario())


def test_a_big_head_blocks_smaller_requests_behind_it() -> None:
    async def scenario() -> None:
        a = admission()
        running = await a.acquire(6)  # 6 of 10 blocks
        big = asyncio.create_task(a.acquire(8))  # fits only when `running` ends
        await asyncio.sleep(0.01)
        small = asyncio.create_task(a.acquire(1))  # would fit, but arrived later: waits its turn
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done()
        running.release()
        (await big).release()
        await small

    run(scenario())


def test_beyond_the_bound_a_request_is_refused_at_once_with_retry_after() -> None:
    refused: list[str] = []

    async def scenario() -> None:
        a = admission(on_refused=refused.append)  # slots 2: two run, two may wait
        tickets = [await a.acquire(1), await a.acquire(1)]
        waiting = [asyncio.create_task(a.acquire(1)) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(AdmissionRefused) as info:
            await a.acquire(1)
        assert info.value.reason == "queue_full" and info.value.status_code == 429
        assert 1 <= info.value.retry_after_s <= 60
        for ticket in tickets:
            ticket.release()
        for ticket in await asyncio.gather(*waiting):
            ticket.release()

    run(scenario())
    assert refused == ["queue_full"]


def test_a_request_queued_past_its_timeout_leaves_with_503() -> None:
    refused: list[str] = []

    async def scenario() -> None:
        a = admission(queue_timeout_s=0.05, on_refused=refused.append)
        held = [await a.acquire(1), await a.acquire(1)]
        with pytest.raises(AdmissionRefused) as info:
            await a.acquire(1)
        assert info.value.reason == "queue_timeout" and info.value.status_code == 503
        assert a.num_queued == 0
        for ticket in held:
            ticket.release()
        assert a.in_flight == Usage()

    run(scenario())
    assert refused == ["queue_timeout"]


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing() -> None:
    async def scenario() -> None:
        a = admission()
        held = [await a.acquire(1), await a.acquire(1)]
        gone = asyncio.create_task(a.acquire(1))
        behind = asyncio.create_task(a.acquire(1))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert a.num_queued == 1
        held[0].release()
        (await behind).release()
        held[1].release()
        assert a.in_flight == Usage() and a.num_queued == 0

    run(scenario())


def test_more_capacity_moves_the_queue() -> None:
    async def scenario() -> None:
        a = admission()
        held = [await a.acquire(1), await a.acquire(1)]
        waiting = asyncio.create_task(a.acquire(1))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        a.update([load("d0", max_num_seqs=2), load("d1", max_num_seqs=2)])  # a worker joined
        (await waiting).release()
        for ticket in held:
            ticket.release()

    run(scenario())


def test_the_mean_hold_time_bounds_the_queue() -> None:
    now = [0.0]

    async def scenario() -> None:
        a = Admission(role="decode", queue_timeout_s=5.0, clock=lambda: now[0])
        a.update([load("d0", max_num_seqs=2, kv_blocks_total=100)])
        first = await a.acquire(1)
        now[0] = 4.0
        first.release()  # held 4 s: 2 slots, so each queued request adds 2 s of expected wait
        assert a.mean_hold_s == 4.0
        held = [await a.acquire(1), await a.acquire(1)]
        waiting = [asyncio.create_task(a.acquire(1)) for _ in range(2)]  # 2 s and 4 s expected
        await asyncio.sleep(0.01)
        assert a.num_queued == 2
        with pytest.raises(AdmissionRefused) as info:  # a third would wait 6 s > 5 s
            await a.acquire(1)
        assert info.value.retry_after_s == 6
        for ticket in held:
            ticket.release()
        for ticket in await asyncio.gather(*waiting):
            ticket.release()

    run(scenario())


def test_disabled_admission_dispatches_everything_at_once() -> None:
    async def scenario() -> None:
        a = Admission(role="decode", enabled=False)
        a.update([load("d0", max_num_seqs=1, kv_blocks_total=2)])
        tickets = [await a.acquire(2) for _ in range(10)]
        assert a.num_queued == 0 and a.in_flight == Usage()  # nothing counted
        for ticket in tickets:
            ticket.release()

    run(scenario())
