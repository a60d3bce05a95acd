"""The gateway's side of the prefix index on a real redis-server: lookups of live incarnations only, provisional
entries that a second gateway sees, predictions counted, and a Redis that goes away costing nothing but the index."""

from __future__ import annotations

import asyncio

import pytest

from deploy.redis_server import EmbeddedRedis
from kv_transfer import prefix_index as pi
from kv_transfer.block_hash import BlockHashNamespace, hash_token_blocks
from kv_transfer.kv_events import BlockStored
from router.prefix_index_client import PrefixIndexClient
from router.prefix_routing import PrefixIndex, predicted_cached_tokens
from router.routing import Route, WorkerLoad, plan_route

pytestmark = pytest.mark.redis

NS = BlockHashNamespace(model="sha256:router", block_size=4, kv_dtype="float32")
PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks
HASHES = hash_token_blocks(NS, PROMPT)


def publish(url: str, worker_id: str, incarnation: int, hashes, role: str = "prefill", *,
            disk=()) -> None:
    """A reset batch: `hashes` on the worker's device, `disk` on its disk tier."""
    import redis

    with redis.Redis.from_url(url) as r:
        events = (BlockStored(block_hashes=tuple(hashes)), BlockStored(block_hashes=tuple(disk), tier="disk"))
        batch = pi.EventBatch(publisher=pi.PublisherId(worker_id=worker_id, incarnation=incarnation, role=role),
                              seq=1, reset=True, events=events)
        assert r.eval(pi.APPLY, 0, *pi.apply_args(pi.key_prefix(NS), batch)) == b"ok"


def load(worker_id: str, role: str, incarnation: int = 1, running: int = 0) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, endpoint=f"{worker_id}:1", healthy=True, num_running=running,
                      kv_blocks_free=100, kv_blocks_total=100, incarnation=incarnation)


@pytest.fixture
def url(redis_url):
    import redis

    with redis.Redis.from_url(redis_url) as r:
        r.flushdb()
    return redis_url


def run(coroutine):
    return asyncio.run(coroutine)


def test_predicted_hit_is_whole_blocks_and_never_the_whole_prompt() -> None:
    assert predicted_cached_tokens(7, 30, 4) == 28
    assert predicted_cached_tokens(8, 32, 4) == 28  # fully cached: the last block is computed again
    assert predicted_cached_tokens(3, 30, 4) == 12
    assert predicted_cached_tokens(0, 30, 4) == 0


def test_lookup_counts_live_incarnations_only(url) -> None:
    publish(url, "p0", 1, HASHES[:5])
    publish(url, "p1", 7, HASHES[:7])  # p1 restarted since: the registry knows incarnation 8
    publish(url, "d0", 1, HASHES[:3], role="decode")

    async def main() -> None:
        index = PrefixIndex(PrefixIndexClient(url), namespace=lambda: NS,
                            live_workers=lambda: {"p0": 1, "p1": 8, "d0": 1})
        await index.client.start()
        try:
            lookup = await index.lookup(PROMPT)
            assert lookup is not None and lookup.block_hashes == HASHES
            assert lookup.overlap == {"p0": 5, "d0": 3}
            assert index.client.counters.lookups == {"ok": 1, "error": 0, "down": 0}
        finally:
            await index.close()

    run(main())


def test_lookup_and_stats_know_where_each_workers_blocks_are(url) -> None:
    """p0 holds the prompt's 7 blocks, 0-2 on its device and 3-6 on disk; p1 holds 5 on its device; p9 is not live.
    The lookup keeps "held" as before and adds the tiers; routing prices p0's disk blocks; the stats and the
    metrics collector list blocks per worker and tier."""
    from prometheus_client import CollectorRegistry, generate_latest

    from router.metrics import PrefixIndexCollector

    publish(url, "p0", 1, HASHES[:3], disk=HASHES[3:7])
    publish(url, "p1", 1, HASHES[:5] + hash_token_blocks(NS, [1] * 8))  # and 2 blocks of another prompt
    publish(url, "p9", 1, HASHES[:7], disk=HASHES[:1])

    async def main() -> None:
        index = PrefixIndex(PrefixIndexClient(url), namespace=lambda: NS, live_workers=lambda: {"p0": 1, "p1": 1})
        await index.client.start()
        try:
            lookup = await index.lookup(PROMPT)
            assert lookup is not None and lookup.overlap == {"p0": 7, "p1": 5}
            assert lookup.overlap_by_tier == {"p0": {"device": 3, "disk": 4}, "p1": {"device": 5}}
            assert lookup.lower_tier_blocks == {"p0": {"disk": 4}}
            assert (lookup.device_reach("p0", 0), lookup.device_reach("p0", 3), lookup.device_reach("p1", 2)) == (
                3, 3, 5)
            loads = [load("p0", "colocated"), load("p1", "colocated")]
            # By overlap alone p0 (1 block to compute) beats p1 (3); priced by tier, p0 costs 1 + 4 x 0.25 = 2 < 3.
            assert plan_route("colocated", loads, num_blocks=8, prefix_overlap_blocks=lookup.overlap,
                              prefix_tier_blocks=lookup.lower_tier_blocks).target.worker_id == "p0"
            stats = {s.worker_id: s.num_blocks_by_tier for s in await index.client.worker_stats(NS)}
            assert stats == {"p0": {"device": 3, "disk": 4}, "p1": {"device": 7}, "p9": {"device": 6, "disk": 1}}
            registry = CollectorRegistry()
            registry.register(PrefixIndexCollector(index.client))
            text = generate_latest(registry).decode()
            assert 'splitserve:prefix_index_blocks{tier="disk",worker="p0"} 4.0' in text
            assert 'splitserve:prefix_index_blocks{tier="device",worker="p1"} 7.0' in text
            await index.client.refresh_stats(None)  # no namespace known: nothing listed
            assert "splitserve:prefix_index_blocks{" not in generate_latest(registry).decode()
            await index.client.refresh_stats(NS)
            assert 'splitserve:prefix_index_blocks{tier="device",worker="p0"} 3.0' in generate_latest(
                registry).decode()
        finally:
            await index.close()

    run(main())


def test_a_second_gateway_sees_the_first_ones_routing_decision(url) -> None:
    """Two gateways over one Redis, before any KV event: the second routes a prompt of the same family where the
    first sent it, although its own view of the loads would break the tie the other way."""
    live = {"p0": 1, "p1": 1, "d0": 1}

    async def route_once(index: PrefixIndex, loads: list[WorkerLoad]) -> Route:
        lookup = await index.lookup(PROMPT)
        route = plan_route("disaggregated", loads, num_blocks=8,
                           prefix_overlap_blocks=lookup.overlap if lookup else None)
        index.record(lookup, route)
        await asyncio.gather(*index._background)
        return route

    async def main() -> None:
        first = PrefixIndex(PrefixIndexClient(url), namespace=lambda: NS, live_workers=lambda: live)
        second = PrefixIndex(PrefixIndexClient(url), namespace=lambda: NS, live_workers=lambda: live)
        await first.client.start()
        await second.client.start()
        try:
            # Nothing cached anywhere, all idle: the first gateway picks p0 (ties go by id) and records it.
            idle = [load("p0", "prefill"), load("p1", "prefill"), load("d0", "decode")]
            assert (await route_once(first, idle)).prefill.worker_id == "p0"
            # The second gateway sees p0 one request busier (say, its own dispatch): by load alone it would pick
            # p1; p0's provisional entries (7 of 8 blocks) keep the family together: 1 + 1 x 1 < 8.
            busier_p0 = [load("p0", "prefill", running=1), load("p1", "prefill"), load("d0", "decode")]
            assert plan_route("disaggregated", busier_p0, num_blocks=8).prefill.worker_id == "p1"
            assert (await route_once(second, busier_p0)).prefill.worker_id == "p0"
            lookup = await second.lookup(PROMPT)
            assert lookup is not None and lookup.overlap == {"p0": 7, "d0": 7}
        finally:
            await first.close()
            await second.close()

    run(main())


def test_predictions_are_counted(url) -> None:
    publish(url, "p0", 1, HASHES[:4])

    async def main() -> None:
        index = PrefixIndex(PrefixIndexClient(url), namespace=lambda: NS, live_workers=lambda: {"p0": 1, "d0": 1})
        await index.client.start()
        try:
            lookup = await index.lookup(PROMPT)
            route = Route(target=load("d0", "decode"), prefill=load("p0", "prefill"))
            index.check_prediction(lookup, route, num_prompt_tokens=30, num_cached_tokens=16)
            index.check_prediction(lookup, route, num_prompt_tokens=30, num_cached_tokens=0)
            assert index.client.counters.predictions == {"match": 1, "mismatch": 1}
        finally:
            await index.close()

    run(main())


def test_redis_going_away_costs_only_the_index() -> None:
    server = EmbeddedRedis().start()
    states: list[bool] = []

    async def main() -> None:
        nonlocal server
        client = PrefixIndexClient(server.url, timeout_s=0.2, ping_interval_s=0.1, on_state=states.append)
        index = PrefixIndex(client, namespace=lambda: NS, live_workers=lambda: {})
        await client.start()
        try:
            assert client.up and (await index.lookup(PROMPT)) is not None
            port = server.port
            server.stop()
            assert await index.lookup(PROMPT) is None  # the failing call marks it down at once
            assert not client.up
            loop = asyncio.get_running_loop()
            start = loop.time()
            assert await index.lookup(PROMPT) is None  # down: answered at once, no connection attempt
            assert loop.time() - start < 0.05
            assert client.counters.lookups["error"] == 1 and client.counters.lookups["down"] == 1
            server = EmbeddedRedis(port=port).start()
            for _ in range(50):
                if client.up:
                    break
                await asyncio.sleep(0.1)
            assert client.up and (await index.lookup(PROMPT)) is not None
        finally:
            await index.close()

    try:
        run(main())
    finally:
        server.stop()
    assert states[0] is True and False in states and states[-1] is True


def test_no_namespace_yet_means_no_lookup(url) -> None:
    async def main() -> None:
        index = PrefixIndex(PrefixIndexClient(url), namespace=lambda: None, live_workers=lambda: {})
        await index.client.start()
        try:
            assert await index.lookup(PROMPT) is None
            assert index.client.counters.lookups == {"ok": 0, "error": 0, "down": 0}
        finally:
            await index.close()

    run(main())
