"""The cluster-wide prefix index end to end: real workers (real engines on the real model, real gRPC) publishing
to a real redis-server, the real gateway app routing by it over HTTP.

One cluster for the module: 2 prefill workers and 1 decode worker in this process, a gateway in front. Tests
that need another shape (a second gateway, a restarted worker) build it beside the module's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import httpx
import pytest
import redis as redis_client

from deploy.redis_server import EmbeddedRedis
from engine.request.sampling_params import SamplingParams
from kv_transfer import prefix_index as pi
from protos import serving_pb2
from protos.worker_info import WorkerInfo
from router.app import create_app
from router.config import RouterConfig
from router.prefix_index_client import PrefixIndexClient
from router.prefix_routing import PrefixIndex
from router.server import RouterServer
from router.worker_registry import WorkerRegistry
from tests.cluster.worker_harness import generate, start_worker, stub, wait_blocks_free

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MODEL = "smollm2-135m"
BLOCK = 16
SYSTEM = [
    "You are a careful assistant for a lighthouse museum. Answer questions about the history of lighthouses, "
    "their keepers, their lenses and their lamps, and decline anything else politely. ",
    "You are a terse assistant for a railway timetable office. Answer questions about trains, platforms and "
    "connections in one sentence, and never guess a departure time you were not given. ",
]
# Prompt families of five full blocks and more: a family's worker computes one block of a new turn, any other
# worker six, so a few requests queued there (or counted pending by the router) never outweigh the prefix.
FAMILIES = [
    "You are the archivist of a small harbour town. You answer questions about its ships, its storms, its fishing "
    "fleets and the families who kept its harbour lights burning through two centuries, quoting the ledgers and "
    "letters in the town archive where you can, and saying plainly when the archive is silent on a point. Keep "
    "every answer under five sentences, name the document you relied on, and never invent a ship or a date that "
    "the archive does not hold. ",
    "You are the booking assistant of a mountain hut association. You answer questions about huts, their opening "
    "seasons, the paths between them, the snow conditions reported by their wardens and the rules for reserving a "
    "bunk, and you never promise a bed that the reservation system has not confirmed. Keep every answer short and "
    "practical, give walking times in hours, and remind walkers to carry a map, water and a warm layer. ",
    "You are a patient tutor for a night class in bookkeeping. You explain ledgers, journals, trial balances and "
    "the difference between cash and accrual accounting to adults who are new to the subject, with one small "
    "worked example per answer, and you check their arithmetic gently when they share it with you. When a learner "
    "is stuck, ask one question that points to the next step instead of giving the answer away. ",
]


@dataclass
class Cluster:
    redis: EmbeddedRedis
    prefill: list
    decode: list
    gateways: list[RouterServer]
    checkpoint: object

    @property
    def workers(self) -> list:
        return [*self.prefill, *self.decode]

    def infos(self) -> list[WorkerInfo]:
        return [WorkerInfo(worker_id=w.worker_id, role=w.role, endpoint=w.endpoint, incarnation=w.incarnation)
                for w in self.workers]

    def gateway(self, threshold: int = 0, policy: str = "prefix-aware", peer_fetch: bool = True) -> RouterServer:
        config = RouterConfig(served_model_names=(MODEL,), max_model_len=1024, block_size=BLOCK,
                              routing_policy=policy, disagg_prefill_threshold_tokens=threshold,
                              kv_peer_fetch=peer_fetch)
        registry = WorkerRegistry(self.infos, refresh_interval_s=0.3, load_timeout_s=5.0)
        index = PrefixIndex(PrefixIndexClient(self.redis.url, ping_interval_s=0.2), namespace=registry.hash_namespace,
                            live_workers=registry.incarnations)
        server = RouterServer(create_app(config, registry, self.checkpoint.tokenizer, prefix_index=index)).start()
        self.gateways.append(server)
        return server


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    """A greedy completion of exactly `max_tokens` tokens (ignore_eos: a request that ended on its first token
    would never reach the decode worker, and the tests count what the decode worker holds)."""
    response = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


class PrefixCounters(NamedTuple):
    queries: int  # prompt tokens looked up in the worker's prefix cache
    hits: int  # of which found there


def prefill_counters(cluster: Cluster) -> dict[str, PrefixCounters]:
    """Each prefill worker's own prefix-cache counters, from its GetLoad."""
    loads = [stub(w).GetLoad(serving_pb2.LoadRequest(), timeout=10) for w in cluster.prefill]
    return {load.worker_id: PrefixCounters(load.prefix_cache_queries, load.prefix_cache_hits) for load in loads}


def pool_hashes(worker) -> set[bytes]:
    return set(worker.runtime.loop.call(lambda e: e.block_pool.cached_block_hashes()))


def index_hashes(cluster: Cluster, worker) -> set[bytes]:
    prefix = pi.key_prefix(worker.runtime.engine.hash_namespace)
    with redis_client.Redis.from_url(cluster.redis.url) as r:
        return {bytes.fromhex(h.decode()) for h in r.smembers(pi.worker_blocks_key(prefix, worker.worker_id))}


def wait_index_matches_pools(cluster: Cluster, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        pairs = {w.worker_id: (pool_hashes(w), index_hashes(cluster, w)) for w in cluster.workers}
        if all(pool == index for pool, index in pairs.values()):
            assert any(pool for pool, _ in pairs.values())
            return
        if time.monotonic() > deadline:
            raise AssertionError({wid: (len(p), len(i), len(p - i), len(i - p)) for wid, (p, i) in pairs.items()})
        time.sleep(0.1)


def metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


@pytest.fixture(scope="module")
def cluster(smollm2_checkpoint) -> Iterator[Cluster]:
    server = EmbeddedRedis().start()
    common = dict(redis_url=server.url, num_threads=1, num_kv_blocks=256)
    prefill = [start_worker("prefill", smollm2_checkpoint, worker_id=f"prefill-{i}", incarnation=1, **common)
               for i in range(2)]
    decode = [start_worker("decode", smollm2_checkpoint, worker_id="decode-0", incarnation=1, **common)]
    c = Cluster(redis=server, prefill=prefill, decode=decode, gateways=[], checkpoint=smollm2_checkpoint)
    try:
        yield c
    finally:
        for gateway in c.gateways:
            gateway.stop()
        for worker in c.workers:
            worker.stop()
        server.stop()
        c.redis.stop()  # the Redis-outage test puts a new server in its place


@pytest.fixture(scope="module")
def gateway(cluster: Cluster) -> str:
    return cluster.gateway().url


def test_each_family_is_prefilled_where_its_prefix_is_cached_and_the_index_lists_every_block(cluster) -> None:
    """Families 0 and 1 are put on prefill-0 and prefill-1 by hand (the decode worker's own Generate naming that
    prefill worker, no gateway); family 2 is new to both. Then, through the gateway, turns of one family follow
    each other: round-robin would split them between the two workers, and least-loaded (equal loads, ties by id)
    would send family 1 to prefill-0. Each turn must be prefilled on its family's worker, with the family's
    blocks found there: the workers' own prefix counters (GetLoad) say which one ran it and what it found.

    Peer fetch off: a turn that follows its family's last one within the in-flight window sees the family's worker
    as busy, and on a loaded machine the measured rates may then price fetching the prefix to the other worker
    below waiting (router/inflight_prefixes.py); that choice is peer fetch's, tested below."""
    gateway = cluster.gateway(peer_fetch=False).url
    tok = cluster.checkpoint.tokenizer
    decode = stub(cluster.decode[0])
    for family, worker in zip(FAMILIES[:2], cluster.prefill, strict=True):
        placed = generate(decode, f"place-{worker.worker_id}", tok.encode(family + "Hello?"),
                          SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), worker.endpoint)
        assert not placed.error, placed.error
    wait_index_matches_pools(cluster)
    home = {0: cluster.prefill[0].worker_id, 1: cluster.prefill[1].worker_id}
    order = (1, 1, 2, 0, 0, 2, 1, 0, 2)
    for turn, family in enumerate(order):
        before = prefill_counters(cluster)
        body = complete(gateway, FAMILIES[family] + f"Question {turn}?")
        after = prefill_counters(cluster)
        ran = [wid for wid in after if after[wid].queries > before[wid].queries]
        assert len(ran) == 1, (turn, before, after)
        hit = after[ran[0]].hits - before[ran[0]].hits
        first_of_family = family not in home
        home.setdefault(family, ran[0])
        assert (ran[0], cached_tokens(body)) == (home[family], hit), (turn, family, home)
        if first_of_family:
            assert hit == 0, (turn, family, hit)
        else:  # at least the family's full blocks (the turn's own text starts in the block after them)
            assert hit >= (len(tok.encode(FAMILIES[family])) // BLOCK) * BLOCK > 0, (turn, family, hit)
    wait_index_matches_pools(cluster)
    predictions = metric(gateway, "splitserve:prefix_index_predictions_total")
    assert predictions[(("outcome", "match"),)] == len(order), predictions  # the index foresaw every hit
    assert predictions.get((("outcome", "mismatch"),), 0) == 0, predictions
    status = httpx.get(f"{gateway}/v1/prefix_index", timeout=10).json()
    assert status["up"] and status["routing_policy"] == "prefix-aware"
    by_worker = {w["worker_id"]: w for w in status["workers"]}
    for worker in cluster.workers:
        assert by_worker[worker.worker_id]["num_blocks"] == len(pool_hashes(worker))
        assert by_worker[worker.worker_id]["incarnation"] == worker.incarnation and by_worker[worker.worker_id]["live"]
    wait_blocks_free(*cluster.workers)


def test_round_robin_spreads_the_same_family_and_recomputes_it(cluster) -> None:
    url = cluster.gateway(policy="round-robin", peer_fetch=False).url
    family = ("You are a friendly guide to a botanical garden: describe plants, their seasons and where in the "
              "garden to find them. A question, asked ")
    bodies = [complete(url, family + word) for word in ("once.", "twice.", "thrice.", "again.")]
    # Turns alternate between the two prefill workers: each computes the family once, then finds it cached.
    assert [cached_tokens(b) > 0 for b in bodies] == [False, False, True, True]
    assert all(pool_hashes(w) & set(_hashes(cluster, family)) for w in cluster.prefill)


def _peer_hits(cluster: Cluster) -> dict[str, int]:
    loads = [stub(w).GetLoad(serving_pb2.LoadRequest(), timeout=10) for w in cluster.prefill]
    return {load.worker_id: load.prefix_cache_hits_by_tier["peer"] for load in loads}


def test_round_robin_with_peer_fetch_fetches_the_family_instead_of_recomputing_it(cluster) -> None:
    """The same turns as above, peer fetch on (the default): the second turn lands on the other prefill worker,
    which fetches the family's blocks from a worker holding them (the first prefill worker, or the decode worker
    that received them) instead of computing them, and answers exactly as a recompute does."""
    url = cluster.gateway(policy="round-robin").url
    family = ("You are a friendly guide to a city zoo: describe its animals, their feeding times and where in the "
              "zoo to find them. A question, asked ")
    before_hits = _peer_hits(cluster)
    before = metric(url, "splitserve:kv_peer_fetch_decisions_total")
    bodies = []
    for word in ("once.", "twice.", "thrice."):
        bodies.append(complete(url, family + word))
        wait_index_matches_pools(cluster)  # the index has heard of the turn's blocks before the next one routes
    assert [cached_tokens(b) > 0 for b in bodies] == [False, True, True]
    after = metric(url, "splitserve:kv_peer_fetch_decisions_total")
    assert after[(("decision", "fetch"),)] - before.get((("decision", "fetch"),), 0) == 1, after
    full_blocks = len(cluster.checkpoint.tokenizer.encode(family)) // BLOCK
    fetched = {wid: n - before_hits[wid] for wid, n in _peer_hits(cluster).items()}
    assert sorted(fetched.values()) == [0, full_blocks * BLOCK], fetched  # the second turn's worker, its family
    assert metric(url, "splitserve:kv_peer_fetch_blocks_total")  # the gateway exports the workers' counters
    # Greedy: the fetched KV gives the tokens the computed one gives.
    recomputed = complete(cluster.gateway(policy="round-robin", peer_fetch=False).url, family + "twice.")
    assert bodies[1]["choices"][0]["text"] == recomputed["choices"][0]["text"]
    wait_blocks_free(*cluster.workers)


def _hashes(cluster: Cluster, text: str) -> list[bytes]:
    from kv_transfer.block_hash import hash_token_blocks

    return hash_token_blocks(cluster.workers[0].runtime.engine.hash_namespace,
                             cluster.checkpoint.tokenizer.encode(text))


def test_a_second_gateway_routes_a_family_where_the_first_did(cluster, gateway) -> None:
    second = cluster.gateway().url
    family = "You are a patient tutor for a school chess club: explain openings to beginners step by step. "
    complete(gateway, family + "What is the Italian game?")
    # No wait for any KV event: the first gateway's provisional entries are in Redis already.
    body = complete(second, family + "What is the Sicilian defence?")
    assert cached_tokens(body) >= (len(cluster.checkpoint.tokenizer.encode(family)) // BLOCK) * BLOCK


def test_evictions_leave_the_index_equal_to_the_pools(smollm2_checkpoint) -> None:
    with EmbeddedRedis() as server:
        small = dict(redis_url=server.url, num_threads=1, num_kv_blocks=80)
        workers = [start_worker("prefill", smollm2_checkpoint, worker_id="prefill-0", incarnation=5, **small),
                   start_worker("decode", smollm2_checkpoint, worker_id="decode-0", incarnation=5, **small)]
        c = Cluster(redis=server, prefill=workers[:1], decode=workers[1:], gateways=[], checkpoint=smollm2_checkpoint)
        try:
            url = c.gateway().url
            for i in range(12):  # ~12 x 5 blocks through 80-block caches: the oldest prompts get evicted
                complete(url, f"Story number {i}: " + SYSTEM[i % 2] * 2)
            evicted = sum(w.runtime.engine.block_pool.num_cached_blocks < 12 * 5 for w in workers)
            assert evicted == 2
            wait_index_matches_pools(c)
        finally:
            for gateway in c.gateways:
                gateway.stop()
            for worker in workers:
                worker.stop()


def test_a_restarted_worker_replaces_its_old_entries(cluster, gateway, smollm2_checkpoint) -> None:
    complete(gateway, SYSTEM[1] + "Before the restart?")
    wait_index_matches_pools(cluster)
    old = cluster.prefill[1]
    assert index_hashes(cluster, old)
    old.stop()
    cluster.prefill[1] = start_worker("prefill", smollm2_checkpoint, worker_id=old.worker_id, incarnation=2,
                                      redis_url=cluster.redis.url, num_threads=1, num_kv_blocks=256)
    # The new incarnation's first batch (an empty snapshot) purges the old one's entries.
    wait_index_matches_pools(cluster)
    assert index_hashes(cluster, cluster.prefill[1]) == set()
    with redis_client.Redis.from_url(cluster.redis.url) as r:
        prefix = pi.key_prefix(old.runtime.engine.hash_namespace)
        assert pi.parse_workers(r.hgetall(pi.workers_key(prefix)))[old.worker_id][0] == 2


def test_redis_down_every_request_is_served_then_the_index_resynchronises(cluster, gateway) -> None:
    port = cluster.redis.port
    cluster.redis.stop()
    try:
        for i in range(4):
            complete(gateway, SYSTEM[i % 2] + f"While Redis is down, question {i}?")
        deadline = time.monotonic() + 10
        while metric(gateway, "splitserve:prefix_index_up")[()] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{gateway}/v1/prefix_index", timeout=10).json()["up"] is False
    finally:
        cluster.redis = EmbeddedRedis(port=port).start()  # back, and empty
    deadline = time.monotonic() + 20
    while metric(gateway, "splitserve:prefix_index_up")[()] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    wait_index_matches_pools(cluster)  # every worker republished a snapshot
    body = complete(gateway, SYSTEM[0] + "After Redis came back?")
    assert cached_tokens(body) > 0


def test_conditional_disaggregation_prefills_a_short_tail_on_the_decode_worker(cluster) -> None:
    url = cluster.gateway(threshold=32).url
    before = metric(url, "splitserve:requests_by_prefill_path_total")
    chat = ("You are the help desk of a seaside ferry company: answer questions about crossings, tickets and "
            "luggage in two sentences at most. Which pier does the 9:15 crossing leave from?")
    first = complete(url, chat, max_tokens=8)  # the decode worker holds none of it: remote prefill
    wait_index_matches_pools(cluster)
    follow_up = chat + first["choices"][0]["text"] + " And the return?"
    second = complete(url, follow_up, max_tokens=8)  # it holds all but the new tail: prefilled locally
    after = metric(url, "splitserve:requests_by_prefill_path_total")
    assert after[(("path", "remote"),)] - before.get((("path", "remote"),), 0) == 1
    assert after[(("path", "local"),)] - before.get((("path", "local"),), 0) == 1
    assert cached_tokens(second) > 0
    # The local path computes exactly what the remote one does (greedy): the same request, disaggregated.
    remote = complete(cluster.gateway(threshold=0).url, follow_up, max_tokens=8)
    assert remote["choices"][0]["text"] == second["choices"][0]["text"]
    wait_blocks_free(*cluster.workers)


def test_reset_prefix_cache_empties_every_worker_and_the_index(cluster, gateway) -> None:
    """vLLM's POST /reset_prefix_cache: every worker forgets its cached blocks between two steps, and its index
    entries with them; the next turn of a family computes it all again. A worker that holds blocks (a request
    running) refuses: 409 naming it, and its cache is left as it was."""
    import contextlib
    import threading

    from tests.cluster.worker_harness import slowed_forward

    prompt = FAMILIES[0] + "Is the archive open on Sundays?"
    complete(gateway, prompt)
    assert cached_tokens(complete(gateway, prompt)) > 0
    wait_blocks_free(*cluster.workers)
    with contextlib.ExitStack() as slowed:
        computing = [slowed.enter_context(slowed_forward(w, 2.0)) for w in cluster.prefill]
        busy = threading.Thread(target=complete, args=(gateway, SYSTEM[1] + "When is the last train?"))
        busy.start()
        deadline = time.monotonic() + 60
        while not any(event.is_set() for event in computing):  # one of them computes the prompt
            assert time.monotonic() < deadline, "the prompt's prefill never started"
            time.sleep(0.01)
        held = {w.worker_id for w in cluster.prefill if w.runtime.engine.block_pool.num_used_blocks}
        refused = httpx.post(f"{gateway}/reset_prefix_cache", timeout=60)
    busy.join(120)
    assert refused.status_code == 409 and not refused.json()["reset"], refused.text
    by_worker = {w["worker_id"]: w for w in refused.json()["workers"]}
    assert set(by_worker) == {w.worker_id for w in cluster.workers}
    assert held and all(not by_worker[wid]["reset"] and by_worker[wid]["kv_blocks_used"] > 0 for wid in held)
    wait_blocks_free(*cluster.workers)
    reset = httpx.post(f"{gateway}/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200 and reset.json()["reset"], reset.text
    assert all(not pool_hashes(w) for w in cluster.workers)
    deadline = time.monotonic() + 20
    while any(index_hashes(cluster, w) for w in cluster.workers):
        assert time.monotonic() < deadline, "the index still lists blocks after the reset"
        time.sleep(0.1)
    assert cached_tokens(complete(gateway, prompt)) == 0  # cold again
    wait_blocks_free(*cluster.workers)
