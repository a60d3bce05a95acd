"""The request gate: what it admits, what it refuses once a drain began, and how long a drain waits."""

from __future__ import annotations

import asyncio
import time

from worker.request_gate import RequestGate


def test_a_drain_refuses_new_calls_and_waits_for_those_in_flight() -> None:
    async def scenario() -> None:
        gate = RequestGate()
        assert gate.enter() and gate.enter() and gate.num_in_flight == 2
        drain = asyncio.create_task(gate.wait_idle(timeout_s=10.0))
        await asyncio.sleep(0.01)
        assert gate.draining and not gate.enter() and gate.num_in_flight == 2  # refused: not counted
        gate.exit()
        await asyncio.sleep(0.01)
        assert not drain.done()  # one call still in flight
        gate.exit()
        assert await asyncio.wait_for(drain, 1.0) == 0

    asyncio.run(scenario())


def test_a_drain_gives_up_after_its_timeout_and_says_how_many_are_left() -> None:
    async def scenario() -> None:
        gate = RequestGate()
        assert gate.enter()
        started = time.monotonic()
        assert await gate.wait_idle(timeout_s=0.2) == 1
        assert 0.2 <= time.monotonic() - started < 2.0
        assert await RequestGate().wait_idle(timeout_s=0.0) == 0  # nothing in flight: no wait at all

    asyncio.run(scenario())
