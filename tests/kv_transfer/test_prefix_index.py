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


def test_first_batch_must_be_a_reset_then_sequence_numbers_follow(redis_db) -> None:
    assert apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))]) == pi.GAP
    assert redis_db.hgetall(pi.workers_key(PREFIX)) == {}
    assert apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True) == pi.OK
    assert apply(redis_db, "p0", 1, 2, [BlockStored(block_hashes=tuple(HASHES[2:4]))]) == pi.OK
    assert apply(redis_db, "p0", 1, 4, [BlockStored(block_hashes=tuple(HASHES[4:5]))]) == pi.GAP  # 3 went missing
    assert held(redis_db, "p0") == set(HASHES[:4])
    assert pi.parse_workers(redis_db.hgetall(pi.workers_key(PREFIX))) == {"p0": (1, "prefill", 2)}
    assert redis_db.hgetall(pi.block_key(PREFIX, HASHES[0])) == {b"p0": b"1"}
    assert 0 < redis_db.ttl(pi.block_key(PREFIX, HASHES[0])) <= pi.BLOCK_TTL_S


def test_lookup_counts_leading_blocks_per_worker_in_one_call(redis_db) -> None:
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:6]))], reset=True)
    apply(redis_db, "p1", 3, 1, [BlockStored(block_hashes=tuple(HASHES[:2]) + tuple(HASHES[3:8]))], reset=True)
    apply(redis_db, "d0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[1:9]))], reset=True, role="decode")
    # p1 lacks block 2, so it holds 2 leading blocks; d0 lacks block 0, so it holds none and never appears.
    assert lookup(redis_db, HASHES) == {("p0", 1): 6, ("p1", 3): 2}
    assert lookup(redis_db, HASHES[:1]) == {("p0", 1): 1, ("p1", 3): 1}
    assert lookup(redis_db, hash_token_blocks(NS, [7] * 8)) == {}


def test_removed_and_cleared_events_remove_entries(redis_db) -> None:
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:4]))], reset=True)
    apply(redis_db, "p1", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:4]))], reset=True)
    apply(redis_db, "p0", 1, 2, [BlockRemoved(block_hashes=(HASHES[2],))])
    assert held(redis_db, "p0") == {HASHES[0], HASHES[1], HASHES[3]}
    assert lookup(redis_db, HASHES[:4]) == {("p0", 1): 2, ("p1", 1): 4}
    apply(redis_db, "p1", 1, 2, [AllBlocksCleared(), BlockStored(block_hashes=(HASHES[0],))])  # in order: clear, store
    assert held(redis_db, "p1") == {HASHES[0]}
    assert redis_db.hgetall(pi.block_key(PREFIX, HASHES[3])) == {b"p0": b"1"}
    assert lookup(redis_db, HASHES[:4]) == {("p0", 1): 2, ("p1", 1): 1}


def test_a_new_incarnation_purges_the_old_ones_entries_and_old_batches_are_stale(redis_db) -> None:
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:4]))], reset=True)
    assert apply(redis_db, "p0", 2, 1, [BlockStored(block_hashes=(HASHES[0],))], reset=True) == pi.OK
    assert held(redis_db, "p0") == {HASHES[0]}
    assert redis_db.exists(pi.block_key(PREFIX, HASHES[1])) == 0  # the last holder left: the key is gone
    assert apply(redis_db, "p0", 1, 2, [BlockStored(block_hashes=tuple(HASHES[:4]))]) == pi.STALE
    assert lookup(redis_db, HASHES[:4]) == {("p0", 2): 1}


def test_entries_of_an_unregistered_incarnation_never_count(redis_db) -> None:
    apply(redis_db, "p0", 2, 1, [BlockStored(block_hashes=tuple(HASHES[:3]))], reset=True)
    redis_db.hset(pi.block_key(PREFIX, HASHES[0]), "p9", 5)  # written by nobody registered
    assert lookup(redis_db, HASHES[:3]) == {("p0", 2): 3}


def test_a_snapshot_replaces_the_workers_entries(redis_db) -> None:
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:5]))], reset=True)
    assert apply(redis_db, "p0", 1, 7, [BlockStored(block_hashes=tuple(HASHES[2:4]))], reset=True) == pi.OK
    assert held(redis_db, "p0") == set(HASHES[2:4])
    assert apply(redis_db, "p0", 1, 8, []) == pi.OK


def test_wall_clock_incarnations_are_exact(redis_db) -> None:
    incarnation = 1795623862347  # the controller's: milliseconds since the epoch
    apply(redis_db, "p0", incarnation, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True)
    assert apply(redis_db, "p0", incarnation + 1, 1, [], reset=True) == pi.OK
    assert apply(redis_db, "p0", incarnation, 2, [BlockStored(block_hashes=(HASHES[0],))]) == pi.STALE
    apply(redis_db, "p0", incarnation + 1, 2, [BlockStored(block_hashes=tuple(HASHES[:2]))])
    assert lookup(redis_db, HASHES) == {("p0", incarnation + 1): 2}
    assert pi.parse_workers(redis_db.hgetall(pi.workers_key(PREFIX))) == {"p0": (incarnation + 1, "prefill", 2)}


def test_purge_removes_every_entry_of_a_worker(redis_db) -> None:
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:5]))], reset=True)
    apply(redis_db, "p1", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True)
    assert redis_db.eval(pi.PURGE, 0, PREFIX, "p0") == 5
    assert held(redis_db, "p0") == set()
    assert pi.parse_workers(redis_db.hgetall(pi.workers_key(PREFIX))) == {"p1": (1, "prefill", 1)}
    assert lookup(redis_db, HASHES) == {("p1", 1): 2}


def test_provisional_entries_count_until_they_expire(redis_db) -> None:
    import time

    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True)
    redis_db.eval(pi.PROVISIONAL, 0, *pi.provisional_args(PREFIX, "p1", 4, HASHES[:6], ttl_s=0.3))
    redis_db.eval(pi.PROVISIONAL, 0, *pi.provisional_args(PREFIX, "p0", 1, HASHES[2:4], ttl_s=0.3))
    # p1 has published nothing yet: its provisional entries count; p0's confirmed + provisional chain continues
    assert lookup(redis_db, HASHES[:6]) == {("p0", 1): 4, ("p1", 4): 6}
    time.sleep(0.5)
    assert lookup(redis_db, HASHES[:6]) == {("p0", 1): 2}


def test_bad_events_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(TypeError):
        pi.encode_ops([object()])


def test_the_controller_purges_a_dead_worker_in_every_namespace(redis_db) -> None:
    other = BlockHashNamespace(model="sha256:other", block_size=16, kv_dtype="bfloat16")
    other_prefix = pi.key_prefix(other)
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:3]))], reset=True)
    apply(redis_db, "p1", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]))], reset=True)
    batch = pi.EventBatch(publisher=pi.PublisherId(worker_id="p0", incarnation=1, role="prefill"), seq=1, reset=True,
                          events=(BlockStored(block_hashes=tuple(HASHES[:4])),))
    redis_db.eval(pi.APPLY, 0, *pi.apply_args(other_prefix, batch))
    assert pi.purge_worker_everywhere(redis_db, "p0") == 7
    assert held(redis_db, "p0") == set()
    assert redis_db.scard(pi.worker_blocks_key(other_prefix, "p0")) == 0
    assert lookup(redis_db, HASHES) == {("p1", 1): 2}


# -- tiers ------------------------------------------------------------------------------------------------------


def held_by_tier(r, hashes):
    return pi.parse_held(r.eval(pi.LOOKUP, 0, *pi.lookup_args(PREFIX, hashes)))


def tiers(r, worker_id):
    """P:wt (the worker's blocks below its device) and P:wtn (their counts), decoded."""
    below = {bytes.fromhex(h.decode()): t.decode()
             for h, t in r.hgetall(pi.worker_tiers_key(PREFIX, worker_id)).items()}
    counts = {t.decode(): int(n) for t, n in r.hgetall(pi.worker_tier_counts_key(PREFIX, worker_id)).items()}
    return below, {t: n for t, n in counts.items() if n}


def test_a_block_moving_to_a_lower_tier_stays_held_under_that_tier(redis_db) -> None:
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:6]))], reset=True)
    assert tiers(redis_db, "p0") == ({}, {})
    assert held_by_tier(redis_db, HASHES) == {("p0", 1): pi.HeldPrefix((("device", 6),))}
    # The device evicts blocks 3-5 into its disk tier: stored again, under "disk"; the union is unchanged.
    apply(redis_db, "p0", 1, 2, [BlockStored(block_hashes=tuple(HASHES[3:6]), tier="disk")])
    assert held(redis_db, "p0") == set(HASHES[:6])
    assert tiers(redis_db, "p0") == (dict.fromkeys(HASHES[3:6], "disk"), {"disk": 3})
    assert lookup(redis_db, HASHES) == {("p0", 1): 6}  # leading blocks held: the same meaning as before
    found = held_by_tier(redis_db, HASHES)[("p0", 1)]
    assert found.runs == (("device", 3), ("disk", 3)) and found.by_tier() == {"device": 3, "disk": 3}
    # Block 4 is loaded back onto the device; block 5 leaves the tier too (removed: held nowhere).
    apply(redis_db, "p0", 1, 3, [BlockStored(block_hashes=(HASHES[4],)), BlockRemoved(block_hashes=(HASHES[5],))])
    assert tiers(redis_db, "p0") == ({HASHES[3]: "disk"}, {"disk": 1})
    found = held_by_tier(redis_db, HASHES)[("p0", 1)]
    assert found.runs == (("device", 3), ("disk", 1), ("device", 1)) and found.num_blocks == 5
    assert [found.device_reach(start) for start in range(6)] == [3, 3, 3, 3, 5, 5]
    # A store under the same tier twice counts once.
    apply(redis_db, "p0", 1, 4, [BlockStored(block_hashes=(HASHES[3], HASHES[0]), tier="disk")])
    assert tiers(redis_db, "p0") == ({HASHES[0]: "disk", HASHES[3]: "disk"}, {"disk": 2})


def test_tiers_go_with_clears_resets_and_purges(redis_db) -> None:
    snapshot = [BlockStored(block_hashes=tuple(HASHES[:2])), BlockStored(block_hashes=tuple(HASHES[2:5]), tier="disk")]
    apply(redis_db, "p0", 1, 1, snapshot, reset=True)
    apply(redis_db, "p1", 1, 1, snapshot, reset=True)
    assert tiers(redis_db, "p0") == (dict.fromkeys(HASHES[2:5], "disk"), {"disk": 3})
    apply(redis_db, "p0", 1, 2, [AllBlocksCleared(), BlockStored(block_hashes=(HASHES[0],), tier="host")])
    assert tiers(redis_db, "p0") == ({HASHES[0]: "host"}, {"host": 1})
    apply(redis_db, "p0", 1, 9, [BlockStored(block_hashes=tuple(HASHES[:3]))], reset=True)  # a snapshot
    assert tiers(redis_db, "p0") == ({}, {})
    apply(redis_db, "p0", 2, 1, [BlockStored(block_hashes=(HASHES[1],), tier="disk")], reset=True)  # restarted
    assert tiers(redis_db, "p0") == ({HASHES[1]: "disk"}, {"disk": 1})
    redis_db.eval(pi.PURGE, 0, PREFIX, "p1")
    assert tiers(redis_db, "p1") == ({}, {})
    assert redis_db.exists(pi.worker_tiers_key(PREFIX, "p1"), pi.worker_tier_counts_key(PREFIX, "p1")) == 0


def test_lookup_reports_each_workers_tiers_and_provisional_entries_on_the_device(redis_db) -> None:
    apply(redis_db, "p0", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:2]), tier="disk"),
                                 BlockStored(block_hashes=tuple(HASHES[2:4]))], reset=True)
    apply(redis_db, "p1", 1, 1, [BlockStored(block_hashes=tuple(HASHES[:5]))], reset=True)
    redis_db.eval(pi.PROVISIONAL, 0, *pi.provisional_args(PREFIX, "p0", 1, HASHES[4:6]))
    redis_db.eval(pi.PROVISIONAL, 0, *pi.provisional_args(PREFIX, "p2", 3, HASHES[:1]))  # not registered yet
    assert held_by_tier(redis_db, HASHES) == {
        ("p0", 1): pi.HeldPrefix((("disk", 2), ("device", 4))),
        ("p1", 1): pi.HeldPrefix((("device", 5),)),
        ("p2", 3): pi.HeldPrefix((("device", 1),)),
    }
    assert lookup(redis_db, HASHES) == {("p0", 1): 6, ("p1", 1): 5, ("p2", 3): 1}


def test_encoded_ops_name_a_lower_tier_on_the_store_marker() -> None:
    events = [BlockStored(block_hashes=(HASHES[0],)), BlockStored(block_hashes=(HASHES[1],), tier="disk"),
              BlockRemoved(block_hashes=(HASHES[2],))]
    assert pi.encode_ops(events) == ["+", HASHES[0].hex(), "+disk", HASHES[1].hex(), "-", HASHES[2].hex()]
