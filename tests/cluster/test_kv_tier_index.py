"""The prefix index knows tiers, end to end: a colocated worker with a disk KV tier (`--kv-offload-dir`, the real
SmolLM2, real gRPC) publishing to a real redis-server, and the real gateway app reading it. A history that other
traffic evicts into the disk tier stays held, listed under tier "disk" (in Redis, in a lookup, in
/v1/prefix_index, in /metrics' prefix_index_blocks), and is listed under "device" again once a returning turn has
loaded it back. Every block goes back."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import httpx
import pytest

from engine.request.sampling_params import SamplingParams
from kv_transfer import prefix_index as pi
from kv_transfer.block_hash import hash_token_blocks
from protos.worker_info import WorkerInfo
from router.app import create_app
from router.config import RouterConfig
from router.prefix_index_client import PrefixIndexClient
from router.prefix_routing import PrefixIndex
from router.server import RouterServer
from router.worker_registry import WorkerRegistry
from tests.cluster.worker_harness import generate, start_worker, stub, wait_blocks_free

pytestmark = [pytest.mark.slow, pytest.mark.redis]

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ENGINE = dict(num_kv_blocks=24, max_model_len=384, block_size=16)
RNG = random.Random(5)
HISTORY = RNG.choices(range(100, 40_000), k=160)  # 10 blocks; the two others (13 blocks each) evict them
OTHERS = [RNG.choices(range(100, 40_000), k=200) for _ in range(2)]
WORKER = "c-tier-index"


def wait_for(check: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    """Until `check()` is truthy: the index follows the worker's events asynchronously (its publisher thread)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_blocks_evicted_to_disk_are_indexed_under_disk_and_under_device_once_loaded(
        smollm2_checkpoint, tmp_path, redis_db, redis_url) -> None:
    tier = dict(kv_offload_dir=str(tmp_path), kv_offload_size_bytes=1 << 30)
    worker = start_worker("colocated", smollm2_checkpoint, worker_id=WORKER, incarnation=1, redis_url=redis_url,
                          **ENGINE, **tier)
    infos = [WorkerInfo(worker_id=WORKER, role="colocated", endpoint=worker.endpoint, incarnation=1)]
    registry = WorkerRegistry(lambda: infos, refresh_interval_s=0.3, load_timeout_s=5.0)
    index = PrefixIndex(PrefixIndexClient(redis_url, ping_interval_s=0.2), namespace=registry.hash_namespace,
                        live_workers=registry.incarnations)
    config = RouterConfig(served_model_names=("smollm2",), max_model_len=384, block_size=16, mode="colocated")
    gateway = RouterServer(create_app(config, registry, smollm2_checkpoint.tokenizer, prefix_index=index)).start()
    namespace = worker.runtime.engine.hash_namespace
    prefix = pi.key_prefix(namespace)
    history = hash_token_blocks(namespace, HISTORY)
    assert len(history) == 10

    def tiers_in_redis() -> dict[bytes, str]:
        """P:wt: the worker's blocks below its device, and their tier."""
        return {bytes.fromhex(h.decode()): t.decode()
                for h, t in redis_db.hgetall(pi.worker_tiers_key(prefix, WORKER)).items()}

    def held_in_redis() -> set[bytes]:
        return {bytes.fromhex(h.decode()) for h in redis_db.smembers(pi.worker_blocks_key(prefix, WORKER))}

    def status() -> dict:
        body = httpx.get(f"{gateway.url}/v1/prefix_index", timeout=10).json()
        entries = [w for w in body["workers"] if w["worker_id"] == WORKER]
        return entries[0] if entries else {}  # {}: the gateway has not read the worker's namespace yet

    def lookup_runs() -> tuple[tuple[str, int], ...]:
        """The history's leading blocks on this worker, by tier, as the gateway's lookup answers them."""
        return pi.parse_held(redis_db.eval(pi.LOOKUP, 0, *pi.lookup_args(prefix, history)))[(WORKER, 1)].runs

    def engine_by_tier() -> dict[str, int]:
        blocks = worker.runtime.loop.call(lambda e: e.cached_blocks())
        return {tier: len(hashes) for tier, hashes in blocks.items()}

    try:
        s = stub(worker)
        first = generate(s, "turn-1", HISTORY, GREEDY).token_ids
        wait_for(lambda: set(history) <= held_in_redis(), "the history indexed")
        assert not set(history) & tiers_in_redis().keys()  # on the device
        assert lookup_runs() == (("device", 10),)

        for i, other in enumerate(OTHERS):  # evict every history block into the disk tier
            generate(s, f"other-{i}", other, GREEDY)
        device = set(worker.runtime.loop.call(lambda e: e.block_pool.cached_block_hashes()))
        assert not set(history) & device
        wait_for(lambda: tiers_in_redis().keys() >= set(history), "the history indexed under its tier")
        assert set(history) <= held_in_redis()  # still held: the union did not lose them
        assert {tiers_in_redis()[h] for h in history} == {"disk"}
        assert lookup_runs() == (("disk", 10),)
        wait_for(lambda: status().get("num_blocks_by_tier") == engine_by_tier(), "the index's tiers to match the engine's")
        entry = status()
        assert entry["live"] and entry["num_blocks_by_tier"]["disk"] >= 10
        assert entry["num_blocks"] == sum(entry["num_blocks_by_tier"].values()) == len(held_in_redis())
        blocks = metric(gateway.url, "splitserve:prefix_index_blocks")
        assert blocks[(("tier", "disk"), ("worker", WORKER))] == entry["num_blocks_by_tier"]["disk"]
        assert blocks[(("tier", "device"), ("worker", WORKER))] == entry["num_blocks_by_tier"]["device"]

        returning = HISTORY + first + [28, 198]
        generate(s, "turn-2", returning, GREEDY)  # loads the history back from disk
        wait_for(lambda: not set(history) & tiers_in_redis().keys(), "the loaded history indexed on the device")
        assert set(history) <= held_in_redis()
        assert lookup_runs() == (("device", 10),)
        wait_for(lambda: status().get("num_blocks_by_tier") == engine_by_tier(), "the index's tiers to match the engine's")
        assert status()["num_blocks_by_tier"]["device"] >= 10
        wait_blocks_free(worker)
    finally:
        gateway.stop()
        worker.stop()

