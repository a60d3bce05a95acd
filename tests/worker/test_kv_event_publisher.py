"""The KV event publisher against a real redis-server: first batch purges an old incarnation, batches follow in
order, a gap or an outage resynchronises by snapshot, a full queue never blocks the engine thread."""

from __future__ import annotations

import time

import pytest

from kv_transfer import prefix_index as pi
from kv_transfer.block_hash import BlockHashNamespace, hash_token_blocks
from kv_transfer.kv_events import BlockRemoved, BlockStored
from worker.kv_event_publisher import NullPublisher, RedisKVEventPublisher

pytestmark = pytest.mark.redis

NS = BlockHashNamespace(model="sha256:pub", block_size=4, kv_dtype="float32")
PREFIX = pi.key_prefix(NS)
H = hash_token_blocks(NS, list(range(32)))


class FakeEngine:
    """Stands in for the engine thread: holds the cached hashes and answers snapshot requests."""

    def __init__(self) -> None:
        self.cached: list[bytes] = []
        self.publisher: RedisKVEventPublisher | None = None
        self.num_snapshots_asked = 0

    def request_snapshot(self) -> None:
        self.num_snapshots_asked += 1
        assert self.publisher is not None
        self.publisher.offer_snapshot(list(self.cached))

    def store(self, *hashes: bytes) -> None:
        self.cached.extend(hashes)
        self.publisher.publish([BlockStored(block_hashes=hashes)])

    def remove(self, *hashes: bytes) -> None:
        for h in hashes:
            self.cached.remove(h)
        self.publisher.publish([BlockRemoved(block_hashes=hashes)])


def make(redis_url: str, engine: FakeEngine, incarnation: int = 1, url: str | None = None) -> RedisKVEventPublisher:
    publisher = RedisKVEventPublisher(
        redis_url=url or redis_url, namespace=NS,
        publisher=pi.PublisherId(worker_id="w0", incarnation=incarnation, role="decode"),
        request_snapshot=engine.request_snapshot, retry_interval_s=0.1, socket_timeout_s=0.5)
    engine.publisher = publisher
    return publisher


def held(r) -> set[bytes]:
    return {bytes.fromhex(h.decode()) for h in r.smembers(pi.worker_blocks_key(PREFIX, "w0"))}


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_events_reach_the_index_in_order_and_the_first_batch_purges_an_old_incarnation(redis_db, redis_url) -> None:
    old = FakeEngine()
    publisher = make(redis_url, old, incarnation=1)
    publisher.start()
    old.store(*H[:5])
    wait_for(lambda: held(redis_db) == set(H[:5]))
    publisher.close()

    engine = FakeEngine()  # the worker restarted: a new incarnation, an empty cache
    publisher = make(redis_url, engine, incarnation=2)
    publisher.start()
    wait_for(lambda: pi.parse_workers(redis_db.hgetall(pi.workers_key(PREFIX))).get("w0", (0,))[0] == 2)
    assert held(redis_db) == set()
    engine.store(*H[:3])
    engine.remove(H[1])
    engine.store(H[7])
    wait_for(lambda: held(redis_db) == {H[0], H[2], H[7]})
    assert publisher.up and publisher.stats.num_gaps == 0 and publisher.stats.num_snapshots == 1
    assert pi.parse_workers(redis_db.hgetall(pi.workers_key(PREFIX)))["w0"] == (2, "decode", 4)
    publisher.close()


def test_a_gap_resynchronises_with_a_snapshot(redis_db, redis_url) -> None:
    engine = FakeEngine()
    publisher = make(redis_url, engine)
    publisher.start()
    engine.store(*H[:4])
    wait_for(lambda: held(redis_db) == set(H[:4]))
    redis_db.flushdb()  # Redis lost its data (a restart without persistence)
    engine.store(H[4])  # applied against an empty index: "gap", then a snapshot of all five
    wait_for(lambda: held(redis_db) == set(H[:5]))
    assert publisher.stats.num_gaps == 1 and publisher.stats.num_snapshots == 2
    publisher.close()


def test_an_outage_drops_events_then_a_snapshot_restores_the_index(redis_db, redis_url) -> None:
    from deploy.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    import redis

    own = redis.Redis.from_url(server.url)
    engine = FakeEngine()
    publisher = make(redis_url, engine, url=server.url)
    try:
        publisher.start()
        engine.store(*H[:2])
        wait_for(lambda: len(own.smembers(pi.worker_blocks_key(PREFIX, "w0"))) == 2)
        port = server.port
        server.stop()
        engine.store(*H[2:4])
        wait_for(lambda: not publisher.up)
        engine.remove(H[0])
        server = EmbeddedRedis(port=port).start()  # back, empty
        own = redis.Redis.from_url(server.url)
        wait_for(lambda: {bytes.fromhex(h.decode()) for h in own.smembers(pi.worker_blocks_key(PREFIX, "w0"))}
                 == {H[1], H[2], H[3]})
        assert publisher.up and publisher.stats.num_errors >= 1
    finally:
        publisher.close()
        own.close()
        server.stop()


def test_publish_never_blocks_and_drops_nothing_silently(redis_db, redis_url) -> None:
    engine = FakeEngine()
    publisher = make(redis_url, engine)  # not started: nothing drains the queue
    import worker.kv_event_publisher as module

    limit, module._MAX_QUEUED_BATCHES = module._MAX_QUEUED_BATCHES, 3
    try:
        start = time.perf_counter()
        for h in H[:6]:
            engine.store(h)
        assert time.perf_counter() - start < 0.5
        assert publisher._num_overflows == 3  # noted; the thread resynchronises by snapshot when it runs
    finally:
        module._MAX_QUEUED_BATCHES = limit
    publisher.start()
    wait_for(lambda: held(redis_db) == set(H[:6]))
    assert publisher.stats.num_dropped >= 3
    publisher.close()


def test_null_publisher_drops_events() -> None:
    publisher = NullPublisher()
    publisher.publish([BlockStored(block_hashes=tuple(H[:2]))])
    assert publisher.up is False


def test_an_idle_worker_notices_its_entries_are_gone_and_republishes(redis_db, redis_url) -> None:
    engine = FakeEngine()
    publisher = make(redis_url, engine)
    publisher.start()
    engine.store(*H[:3])
    wait_for(lambda: held(redis_db) == set(H[:3]))
    redis_db.flushdb()  # Redis restarted empty while this worker has nothing to publish
    wait_for(lambda: held(redis_db) == set(H[:3]))
    # counted once its APPLY call returns, just after Redis shows it (a loaded machine reads in between)
    wait_for(lambda: publisher.stats.num_snapshots >= 2)
    assert publisher.stats.num_snapshots == 2
    publisher.close()
