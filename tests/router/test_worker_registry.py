"""The worker registry against fake workers over real gRPC: polling, health, pending counts, list changes."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from protos import serving_pb2
from router.worker_registry import WorkerInfo, WorkerRegistry
from tests.router.conftest import dead_endpoint, info_of
from tests.router.fake_worker import FakeWorker


@pytest.fixture
def workers(fakes: dict[str, FakeWorker]) -> dict[str, FakeWorker]:
    for fake in fakes.values():
        fake.reset()
    return fakes


def test_polls_loads_and_health(workers: dict[str, FakeWorker]) -> None:
    decode = workers["decode-0"]
    decode.load.num_requests_running = 2
    decode.load.kv_blocks_free = 40
    dead = WorkerInfo(worker_id="gone", role="prefill", endpoint=dead_endpoint())

    async def scenario() -> None:
        registry = WorkerRegistry(lambda: [info_of(decode), dead], refresh_interval_s=60, load_timeout_s=1)
        await registry.start()
        try:
            loads = {load.worker_id: load for load in registry.loads()}
            assert loads["decode-0"].healthy and loads["decode-0"].num_running == 2
            assert loads["decode-0"].kv_blocks_free == 40 and loads["decode-0"].kv_blocks_total == 100
            assert loads["decode-0"].endpoint == decode.endpoint
            assert not loads["gone"].healthy
            snapshots = {s.info.worker_id: s for s in registry.snapshots()}
            assert snapshots["decode-0"].stats is not None and snapshots["decode-0"].stats.worker_id == "decode-0"
            assert snapshots["gone"].stats is None and "GetLoad failed: UNAVAILABLE" in snapshots["gone"].error
            assert registry.healthy_roles() == {"decode"}
            health = await registry.stub("decode-0").Health(serving_pb2.HealthRequest())
            assert health.worker_id == "decode-0"

            decode.load_status = grpc.StatusCode.INTERNAL
            await registry.poll_loads()
            assert registry.healthy_roles() == set()
            decode.load_status = None
            await registry.poll_loads()
            assert registry.healthy_roles() == {"decode"}
            registry.mark_unhealthy("decode-0", "Generate: down")
            assert registry.healthy_roles() == set()
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_dispatches_count_until_the_next_poll(workers: dict[str, FakeWorker]) -> None:
    decode = workers["decode-0"]

    async def scenario() -> None:
        registry = WorkerRegistry(lambda: [info_of(decode)], refresh_interval_s=60)
        await registry.start()
        try:
            registry.note_dispatch("decode-0", 30)
            registry.note_dispatch("decode-0", 30)
            registry.note_dispatch("unknown", 30)  # a worker that left: ignored
            (load,) = registry.loads()
            assert load.num_pending == 2 and load.num_queued == 2 and load.kv_blocks_free == 40
            decode.load.num_requests_running = 2
            decode.load.kv_blocks_free = 40
            await registry.poll_loads()  # the worker's own counts now include them
            (load,) = registry.loads()
            assert load.num_pending == 0 and load.num_queued == 2 and load.kv_blocks_free == 40
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_worker_list_changes(workers: dict[str, FakeWorker]) -> None:
    decode, other = workers["decode-0"], workers["decode-1"]
    listing = [info_of(decode), info_of(other)]
    calls = {"n": 0}

    async def provider() -> list[WorkerInfo]:  # an async provider is awaited in the loop
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("controller hiccup")
        return list(listing)

    async def scenario() -> None:
        registry = WorkerRegistry(provider, refresh_interval_s=60)
        await registry.start()
        try:
            assert {load.worker_id for load in registry.loads()} == {"decode-0", "decode-1"}
            # decode-1 restarts at decode-0's address (incarnation 1); decode-0 leaves.
            listing[:] = [WorkerInfo(worker_id="decode-1", role="decode", endpoint=decode.endpoint, incarnation=1)]
            await registry.refresh()
            (load,) = registry.loads()
            assert load.worker_id == "decode-1" and load.endpoint == decode.endpoint and load.healthy
            assert registry.snapshots()[0].info.incarnation == 1
            await registry.refresh()  # the provider fails: the last list stays
            assert [load.worker_id for load in registry.loads()] == ["decode-1"]
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_background_refresh(workers: dict[str, FakeWorker]) -> None:
    decode = workers["decode-0"]

    async def scenario() -> None:
        registry = WorkerRegistry(lambda: [info_of(decode)], refresh_interval_s=0.05)
        await registry.start()
        try:
            decode.load.num_requests_waiting = 7
            for _ in range(100):
                await asyncio.sleep(0.02)
                if registry.loads()[0].num_waiting == 7:
                    break
            assert registry.loads()[0].num_waiting == 7
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_worker_info_checks_its_role() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerInfo(worker_id="w", role="router", endpoint="h:1")


def test_a_draining_worker_is_polled_and_reachable_but_never_routed(workers: dict[str, FakeWorker]) -> None:
    decode, other = workers["decode-0"], workers["decode-1"]
    listing = [info_of(decode), info_of(other)]

    async def scenario() -> None:
        registry = WorkerRegistry(lambda: list(listing), refresh_interval_s=60)
        await registry.start()
        try:
            registry.note_dispatch("decode-1", 3)
            listing[1] = dataclasses.replace(listing[1], draining=True)  # a scale-down chose decode-1
            await registry.refresh()
            assert [load.worker_id for load in registry.loads()] == ["decode-0"]
            assert registry.incarnations().keys() == {"decode-0"}
            snapshot = {s.info.worker_id: s for s in registry.snapshots()}["decode-1"]
            assert snapshot.healthy and snapshot.info.draining and snapshot.stats is not None  # still polled
            assert (await registry.stub("decode-1").Health(serving_pb2.HealthRequest())).worker_id == "decode-1"
            listing[0] = dataclasses.replace(listing[0], draining=True)
            await registry.refresh()
            assert registry.loads() == [] and registry.healthy_roles() == set()
            listing[:] = [info_of(decode)]  # decode-1 is gone, decode-0 no longer draining
            await registry.refresh()
            assert [load.worker_id for load in registry.loads()] == ["decode-0"]
            assert registry.healthy_roles() == {"decode"}
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_a_load_poll_answered_after_a_later_one_is_dropped(workers: dict[str, FakeWorker]) -> None:
    """A slow poll (started first, its load older) must not overwrite the answer of a poll started after it."""
    decode = workers["decode-0"]

    async def scenario() -> None:
        registry = WorkerRegistry(lambda: [info_of(decode)], refresh_interval_s=60, load_timeout_s=2)
        await registry.start()
        try:
            decode.load.num_requests_running = 7
            decode.load_delay_s = 0.8
            slow = asyncio.ensure_future(registry.poll_loads())  # answers 7, late
            await asyncio.sleep(0.2)
            decode.load.num_requests_running = 3
            decode.load_delay_s = 0.0
            await registry.poll_loads()  # answers 3, first
            await slow
            assert [load.num_running for load in registry.loads()] == [3]
        finally:
            await registry.close()

    asyncio.run(scenario())
