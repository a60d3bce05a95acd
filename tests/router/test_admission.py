"""router.admission: the pure decisions on numbers, then the queue's order, bounds, timeout and cancellation; last,
through HTTP on fake workers, a full queue's refusal before the request's body is read (router/admission_guard.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
from starlette.types import Receive, Scope, Send

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
from router.app import create_app
from router.config import GatewayConfig, RouterConfig
from router.errors import error_body
from router.routing import WorkerLoad
from router.server import RouterServer
from router.worker_registry import WorkerRegistry
from tests.router.conftest import MAX_MODEL_LEN, MODEL, info_of
from tests.router.fake_worker import Script
from tests.router.test_admission_http import BODY, _Holder, queue_one
from tests.router.test_metrics_and_status import scrape, value


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


def admission(on_refused: Callable[[str], None] | None = None, **settings: object) -> Admission:
    a = Admission(GatewayConfig(**settings), role="decode", on_refused=on_refused)  # type: ignore[arg-type]
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
        a = Admission(GatewayConfig(queue_timeout_s=5.0), role="decode", clock=lambda: now[0])
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
        a = Admission(GatewayConfig(admission_control=False), role="decode")
        a.update([load("d0", max_num_seqs=1, kv_blocks_total=2)])
        tickets = [await a.acquire(2) for _ in range(10)]
        assert a.num_queued == 0 and a.in_flight == Usage()  # nothing counted
        for ticket in tickets:
            ticket.release()

    run(scenario())


def test_a_refusal_on_arrival_is_what_acquire_would_answer_at_any_size() -> None:
    refused: list[str] = []

    async def scenario() -> None:
        a = admission(on_refused=refused.append)  # 2 slots, 10 blocks; the queue holds 2 requests
        assert a.refuse_on_arrival() is None  # room: nothing to say before the body
        held = [await a.acquire(1), await a.acquire(1)]
        assert a.refuse_on_arrival() is None  # full pool, empty queue: a request may wait
        waiting = [asyncio.create_task(a.acquire(4))]
        await asyncio.sleep(0.01)
        # Room in the queue for 6 more blocks: a small request may wait, so the body must be read to know its size
        # (acquire refuses a big one by its blocks).
        assert a.refuse_on_arrival() is None
        with pytest.raises(AdmissionRefused):
            await a.acquire(7)
        waiting.append(asyncio.create_task(a.acquire(1)))
        await asyncio.sleep(0.01)
        early = a.refuse_on_arrival()  # the queue's 2 places taken: refused at any size
        assert early is not None and early.reason == "queue_full" and early.status_code == 429
        with pytest.raises(AdmissionRefused) as late:
            await a.acquire(1)
        assert (str(early), early.retry_after_s) == (str(late.value), late.value.retry_after_s)
        assert str(early) == "the server is at capacity (2 requests running, 2 queued); retry later"
        for ticket in held:
            ticket.release()
        for ticket in await asyncio.gather(*waiting):
            ticket.release()
        assert a.in_flight == Usage() and a.refuse_on_arrival() is None

    run(scenario())
    assert refused == ["queue_full"] * 3  # each refusal counted once, early or late
    assert Admission(GatewayConfig(admission_control=False), role="decode").refuse_on_arrival() is None


# -- through HTTP ---------------------------------------------------------------------------------------------
UNREAD = "x-test-body-must-stay-unread"  # a request with this header has a receive that fails the test


class _BodySpy:
    """The gateway's app, whose marked requests get an ASGI receive that records its call and fails: a request
    refused before its body is read never calls it."""

    def __init__(self, app: object) -> None:
        self.app = app
        self.num_reads = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and any(name == UNREAD.encode() for name, _ in scope["headers"]):
            async def unreadable() -> dict[str, object]:
                self.num_reads += 1
                raise AssertionError("the body of a request refused on arrival was read")

            receive = unreadable  # type: ignore[assignment]
        await self.app(scope, receive, send)  # type: ignore[operator]


def test_a_full_queue_refuses_before_the_body_is_read(fakes, tokenizer) -> None:  # type: ignore[no-untyped-def]
    for worker in fakes.values():
        worker.reset()
    prefill, decode = fakes["prefill-0"], fakes["decode-0"]
    decode.load.max_num_seqs = 1  # one running, one queued (max_queued_requests), then 429
    decode.script = Script(hang_after=1)
    config = RouterConfig(served_model_names=(MODEL,), max_model_len=MAX_MODEL_LEN, max_queued_requests=1,
                          queue_timeout_s=30.0, disagg_prefill_threshold_tokens=0)
    registry = WorkerRegistry(lambda: [info_of(prefill), info_of(decode)], refresh_interval_s=0.5,
                              load_timeout_s=1.0)
    spy = _BodySpy(create_app(config, registry, tokenizer))
    server = RouterServer(spy).start()  # type: ignore[arg-type]
    try:
        holder = _Holder(server.url)
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            join_queued = queue_one(client, wait_s=10.0)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
            for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", chat)):
                refused = client.post(path, json=body, headers={UNREAD: "1"})
                assert spy.num_reads == 0, refused.text
                assert refused.status_code == 429, refused.text
                # The dispatcher's refusal, word for word: nothing ended yet, so an expected wait of 0 -> 1 s.
                assert refused.json() == error_body(
                    429, "the server is at capacity (1 requests running, 1 queued); retry later")
                assert refused.headers["retry-after"] == "1"
                assert refused.headers["content-type"] == "application/json"
            assert len(decode.requests) == 1  # only the holder reached a worker
            samples = scrape(client)
            assert value(samples, "splitserve:admission_rejections_total", reason="queue_full") == 2
            assert value(samples, "splitserve:request_failure_total", reason="queue_full") == 2

            decode.script = Script()
            holder.close()  # the slot frees: the queued request goes, and the queue has room again
            queued = join_queued(20.0)
            assert queued.status_code == 200, queued.text
            assert client.post("/v1/completions", json=BODY).status_code == 200  # its body read, as any
    finally:
        server.stop()
        for worker in fakes.values():
            worker.reset()
