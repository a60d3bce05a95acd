"""The prefix index's schema and scripts, on a real redis-server: exact keys and entries after each batch."""

from __future__ import annotations

import pytest

from kv_transfer import prefix_index as pi
from kv_transfer.block_hash import BlockHashNamespace, hash_token_blocks
from kv_transfer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.redis

NS = BlockHashNamespace(model="sha256:abc", block_size=4, kv_dtype="float32")
PREFIX = pi.key_prefix(NS)
HASHES = hash_token_blocks(NS, list(range(40)))  # 10 chained blocks


@pytest.fixture
def r(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def apply(r, worker_id, incarnation, seq, events, *, reset=False, role="prefill"):
    batch = pi.EventBatch(publisher=pi.PublisherId(worker_id=worker_id, incarnation=incarnation, role=role),
                          seq=seq, events=tuple(events), reset=reset)
    answer = r.eval(pi.APPLY, 0, *pi.apply_args(PREFIX, batch))
    return answer.decode()


def lookup(r, hashes):
    return pi.parse_lookup(r.eval(pi.LOOKUP, 0, *pi.lookup_args(PREFIX, hashes)))


def held(r, worker_id):
    return {bytes.fromhex(h.decode()) for h in r.smembers(pi.worker_blocks_key(PREFIX, worker_id))}


def test_keys_are_namespaced_by_model_block_size_and_dtype() -> None:
    other = [BlockHashNamespace(model="sha256:abd", block_size=4, kv_dtype="float32"),
             BlockHashNamespace(model="sha256:abc", block_size=8, kv_dtype="float32"),
             BlockHashNamespace(model="sha256:abc", block_size=4, kv_dtype="bfloat16")]
    prefixes = {pi.key_prefix(NS), *(pi.key_prefix(ns) for ns in other)}
    assert len(prefixes) == 4
    assert PREFIX == "splitserve:pi:v1:" + NS.root.hex()
    assert pi.block_key(PREFIX, HASHES[0]) == f"{PREFIX}:b:{HASHES[0].hex()}"


def test_first_batch_must_be_a_reset_then_sequence_numbers_follow(r) -> None:
    assert apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))]) == pi.GAP
    assert r.hgetall(pi.workers_key(PREFIX)) == {}
    assert apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True) == pi.OK
    assert apply(r, "p0", 1, 2, [BlockStored(block_hashes=tuple(HASHES[2:4]))]) == pi.OK
    assert apply(r, "p0", 1, 4, [BlockStored(block_hashes=tuple(HASHES[4:5]))]) == pi.GAP  # 3 went missing
    assert held(r, "p0") == set(HASHES[:4])
    assert pi.parse_workers(r.hgetall(pi.workers_key(PREFIX))) == {"p0": (1, "prefill", 2)}
    assert r.hgetall(pi.block_key(PREFIX, HASHES[0])) == {b"p0": b"1"}
    assert 0 < r.ttl(pi.block_key(PREFIX, HASHES[0])) <= pi.BLOCK_TTL_S


def test_lookup_counts_leading_blocks_per_worker_in_one_call(r) -> None:
    apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:6]))], reset=True)
    apply(r, "p1", 3, 1, [BlockStored(block_hashes=tuple(HASHES[:2]) + tuple(HASHES[3:8]))], reset=True)
    apply(r, "d0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[1:9]))], reset=True, role="decode")
    # p1 lacks block 2, so it holds 2 leading blocks; d0 lacks block 0, so it holds none and never appears.
    assert lookup(r, HASHES) == {("p0", 1): 6, ("p1", 3): 2}
    assert lookup(r, HASHES[:1]) == {("p0", 1): 1, ("p1", 3): 1}
    assert lookup(r, hash_token_blocks(NS, [7] * 8)) == {}


def test_removed_and_cleared_events_remove_entries(r) -> None:
    apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:4]))], reset=True)
    apply(r, "p1", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:4]))], reset=True)
    apply(r, "p0", 1, 2, [BlockRemoved(block_hashes=(HASHES[2],))])
    assert held(r, "p0") == {HASHES[0], HASHES[1], HASHES[3]}
    assert lookup(r, HASHES[:4]) == {("p0", 1): 2, ("p1", 1): 4}
    apply(r, "p1", 1, 2, [AllBlocksCleared(), BlockStored(block_hashes=(HASHES[0],))])  # in order: clear, store
    assert held(r, "p1") == {HASHES[0]}
    assert r.hgetall(pi.block_key(PREFIX, HASHES[3])) == {b"p0": b"1"}
    assert lookup(r, HASHES[:4]) == {("p0", 1): 2, ("p1", 1): 1}


def test_a_new_incarnation_purges_the_old_ones_entries_and_old_batches_are_stale(r) -> None:
    apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:4]))], reset=True)
    assert apply(r, "p0", 2, 1, [BlockStored(block_hashes=(HASHES[0],))], reset=True) == pi.OK
    assert held(r, "p0") == {HASHES[0]}
    assert r.exists(pi.block_key(PREFIX, HASHES[1])) == 0  # the last holder left: the key is gone
    assert apply(r, "p0", 1, 2, [BlockStored(block_hashes=tuple(HASHES[:4]))]) == pi.STALE
    assert lookup(r, HASHES[:4]) == {("p0", 2): 1}


def test_entries_of_an_unregistered_incarnation_never_count(r) -> None:
    apply(r, "p0", 2, 1, [BlockStored(block_hashes=tuple(HASHES[:3]))], reset=True)
    r.hset(pi.block_key(PREFIX, HASHES[0]), "p9", 5)  # written by nobody registered
    assert lookup(r, HASHES[:3]) == {("p0", 2): 3}


def test_a_snapshot_replaces_the_workers_entries(r) -> None:
    apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:5]))], reset=True)
    assert apply(r, "p0", 1, 7, [BlockStored(block_hashes=tuple(HASHES[2:4]))], reset=True) == pi.OK
    assert held(r, "p0") == set(HASHES[2:4])
    assert apply(r, "p0", 1, 8, []) == pi.OK


def test_wall_clock_incarnations_are_exact(r) -> None:
    incarnation = 1795623862347  # the controller's: milliseconds since the epoch
    apply(r, "p0", incarnation, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True)
    assert apply(r, "p0", incarnation + 1, 1, [], reset=True) == pi.OK
    assert apply(r, "p0", incarnation, 2, [BlockStored(block_hashes=(HASHES[0],))]) == pi.STALE
    apply(r, "p0", incarnation + 1, 2, [BlockStored(block_hashes=tuple(HASHES[:2]))])
    assert lookup(r, HASHES) == {("p0", incarnation + 1): 2}
    assert pi.parse_workers(r.hgetall(pi.workers_key(PREFIX))) == {"p0": (incarnation + 1, "prefill", 2)}


def test_purge_removes_every_entry_of_a_worker(r) -> None:
    apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:5]))], reset=True)
    apply(r, "p1", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True)
    assert r.eval(pi.PURGE, 0, PREFIX, "p0") == 5
    assert held(r, "p0") == set()
    assert pi.parse_workers(r.hgetall(pi.workers_key(PREFIX))) == {"p1": (1, "prefill", 1)}
    assert lookup(r, HASHES) == {("p1", 1): 2}


def test_provisional_entries_count_until_they_expire(r) -> None:
    import time

    apply(r, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True)
    r.eval(pi.PROVISIONAL, 0, *pi.provisional_args(PREFIX, "p1", 4, HASHES[:6], ttl_s=0.3))
    r.eval(pi.PROVISIONAL, 0, *pi.provisional_args(PREFIX, "p0", 1, HASHES[2:4], ttl_s=0.3))
    # p1 has published nothing yet: its provisional entries count; p0's confirmed + provisional chain continues
    assert lookup(r, HASHES[:6]) == {("p0", 1): 4, ("p1", 4): 6}
    time.sleep(0.5)
    assert lookup(r, HASHES[:6]) == {("p0", 1): 2}


def test_bad_events_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(TypeError):
        pi.encode_ops([object()])
