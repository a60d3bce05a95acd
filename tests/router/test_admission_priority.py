"""The gateway's admission queue under the workers' priority policy (router/admission.py, `by_priority`): the queue
in (priority, arrival) order, a request that would head it going at once, a full queue refusing the lowest-ranked
waiters a higher priority outranks, and no early refusal (the priority is in the body); last, over HTTP, the request
field reaching the workers, or a 400 under fcfs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from router.admission import Admission, AdmissionRefused, Usage
from router.config import GatewayConfig
from tests.router.conftest import MODEL, info_of, serve_router
from tests.router.test_admission import load


def admission(on_refused: Callable[[str], None] | None = None, *, by_priority: bool = True,
              **settings: object) -> Admission:
    a = Admission(GatewayConfig(**settings), role="decode", on_refused=on_refused,  # type: ignore[arg-type]
                  by_priority=by_priority)
    a.update([load("d0", max_num_seqs=2, kv_blocks_total=10)])
    return a


@pytest.mark.parametrize(("by_priority", "expected"), [(True, ["f", "d", "c", "e"]), (False, ["c", "d", "e", "f"])])
def test_the_queue_moves_by_priority_then_arrival(by_priority: bool, expected: list[str]) -> None:
    async def scenario() -> None:
        a = admission(by_priority=by_priority, max_queued_requests=8)
        held = [await a.acquire(1), await a.acquire(1)]
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            ticket = await a.acquire(1, priority)
            order.append(name)
            ticket.release()

        waiting = []
        for name, priority in (("c", 5), ("d", 0), ("e", 5), ("f", -1)):
            waiting.append(asyncio.create_task(wait(name, priority)))
            await asyncio.sleep(0.01)
        assert a.num_queued == 4
        held[0].release()
        await asyncio.gather(*waiting)
        assert order == expected
        held[1].release()
        assert a.in_flight == Usage() and a.num_queued == 0

    asyncio.run(scenario())


def test_a_request_that_would_head_the_queue_goes_at_once_when_it_fits() -> None:
    async def scenario() -> None:
        a = admission()
        running = await a.acquire(6)  # 6 of 10 blocks
        big = asyncio.create_task(a.acquire(8, 5))  # fits only when `running` ends
        await asyncio.sleep(0.01)
        urgent = await asyncio.wait_for(a.acquire(1, 0), 1.0)  # outranks the head, and fits: not queued
        assert not big.done() and a.num_queued == 1
        same = asyncio.create_task(a.acquire(1, 5))  # the head's equal: behind it, as in arrival order
        await asyncio.sleep(0.01)
        assert not same.done()
        for ticket in (urgent, running):
            ticket.release()
        (await big).release()
        (await same).release()
        assert a.in_flight == Usage()

    asyncio.run(scenario())


def test_a_full_queue_refuses_the_lowest_waiter_a_higher_priority_outranks() -> None:
    refused: list[str] = []

    async def scenario() -> None:
        a = admission(on_refused=refused.append)  # slots 2: two run, two may wait
        held = [await a.acquire(1), await a.acquire(1)]
        w3, w5 = asyncio.create_task(a.acquire(1, 3)), asyncio.create_task(a.acquire(1, 5))
        await asyncio.sleep(0.01)
        assert a.num_queued == 2 and a.refuse_on_arrival() is None  # its priority is in the body: not known yet
        x = asyncio.create_task(a.acquire(1, 1))
        await asyncio.sleep(0.01)
        with pytest.raises(AdmissionRefused, match="higher priority took this one's place") as info:
            await w5
        assert info.value.reason == "queue_full" and info.value.status_code == 429 and a.num_queued == 2
        with pytest.raises(AdmissionRefused, match="at capacity"):
            await a.acquire(1, 3)  # outranks nobody queued (1, 3): refused itself
        for ticket in held:
            ticket.release()
        (await x).release()
        (await w3).release()
        assert a.in_flight == Usage() and a.num_queued == 0

    asyncio.run(scenario())
    assert refused == ["queue_full", "queue_full"]


def test_a_request_refuses_only_as_many_waiters_as_its_blocks_need() -> None:
    async def scenario() -> None:
        a = admission(max_queued_requests=8)  # the queue's bound is the pool's 10 blocks
        held = [await a.acquire(1), await a.acquire(1)]
        low = [asyncio.create_task(a.acquire(3, 9)) for _ in range(3)]  # 9 blocks queued
        await asyncio.sleep(0.01)
        x = asyncio.create_task(a.acquire(4, 0))  # needs 4: only the last of the three goes (6 + 4 <= 10)
        await asyncio.sleep(0.01)
        with pytest.raises(AdmissionRefused, match="higher priority"):
            await low[2]
        assert not low[0].done() and not low[1].done() and a.num_queued == 3
        for ticket in held:
            ticket.release()
        for task in (x, low[0], low[1]):
            (await task).release()
        assert a.in_flight == Usage()

    asyncio.run(scenario())


def test_the_gateway_sends_a_priority_on_under_the_priority_policy_and_refuses_it_under_fcfs(
    cluster, fakes, tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    refused = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "needs --scheduling-policy priority" in refused.json()["error"]["message"]
    worker = fakes["colocated-0"]
    server = serve_router([info_of(worker)], tokenizer, mode="colocated", scheduling_policy="priority")
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            for body in ({"prompt": "Hi", "priority": -2},
                         {"messages": [{"role": "user", "content": "Hi"}], "priority": 7}, {"prompt": "Hi"}):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                response = client.post(path, json={"model": MODEL, **body})
                assert response.status_code == 200, response.text
    finally:
        server.stop()
    assert [request.params.priority for request in worker.requests] == [-2, 7, 0]
