"""Request migration end to end: real workers (real engines on the real model, real gRPC, a real KV handoff) behind
the real gateway app. A decode worker is stopped mid-stream (its gRPC server stops at once, as a drain's does when
its grace runs out: every call on it fails UNAVAILABLE); the client's stream goes on from another decode worker,
and its greedy text equals an undisturbed run's."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from protos import serving_pb2
from protos.worker_info import WorkerInfo
from router.app import create_app
from router.config import RouterConfig
from router.server import RouterServer
from router.worker_registry import WorkerRegistry
from tests.cluster.load import stream_greedy
from tests.cluster.worker_harness import start_worker, stub, wait_blocks_free
from worker.runtime import FAULT_STEP_SLEEP_ENV

pytestmark = [pytest.mark.slow]

MODEL = "smollm2-135m"
MAX_TOKENS = 40
PROMPT = "The lighthouse keeper climbed the stairs and"
CUT_AFTER = 8  # chunks the client has read when the worker is stopped


@pytest.fixture
def cluster(smollm2_checkpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list, list]]:
    common = {"num_threads": 1, "num_kv_blocks": 64}
    prefill = [start_worker("prefill", smollm2_checkpoint, worker_id="prefill-0", **common)]
    # Decode steps paced (10 ms each) so that the stream is surely still running when its worker is stopped.
    monkeypatch.setenv(FAULT_STEP_SLEEP_ENV, "0.01")
    decode = [start_worker("decode", smollm2_checkpoint, worker_id=f"decode-{i}", **common) for i in range(2)]
    infos = [WorkerInfo(worker_id=w.worker_id, role=w.role, endpoint=w.endpoint) for w in [*prefill, *decode]]
    config = RouterConfig(served_model_names=(MODEL,), max_model_len=1024, routing_policy="least-loaded",
                          disagg_prefill_threshold_tokens=0)
    registry = WorkerRegistry(lambda: infos, refresh_interval_s=0.3, load_timeout_s=5.0)
    server = RouterServer(create_app(config, registry, smollm2_checkpoint.tokenizer)).start()
    try:
        yield server.url, prefill, decode
    finally:
        server.stop()
        for worker in [*prefill, *decode]:
            worker.stop()


def _metric(url: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {next(iter(s.labels.values()), ""): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_a_decode_worker_stopped_mid_stream_hands_the_request_on_with_the_same_greedy_text(cluster) -> None:
    url, prefill, decode = cluster
    expected = stream_greedy(url, MODEL, PROMPT, max_tokens=MAX_TOKENS)
    assert expected.usage["completion_tokens"] == MAX_TOKENS and len(expected.tokens) == MAX_TOKENS
    stopped: list = []

    def stop_the_busy_worker(num_chunks: int) -> None:
        if num_chunks != CUT_AFTER:
            return
        (victim,) = [w for w in decode
                     if stub(w).GetLoad(serving_pb2.LoadRequest(), timeout=10).num_requests_running]
        stopped.append(victim)
        thread = threading.Thread(target=victim.runtime.stop, kwargs={"grace_s": 0})
        thread.start()
        thread.join(timeout=30)

    got = stream_greedy(url, MODEL, PROMPT, max_tokens=MAX_TOKENS, on_chunk=stop_the_busy_worker)
    assert stopped, "the stream ended before a worker was stopped"
    assert got.text == expected.text  # no gap, no duplicate
    assert got.tokens == expected.tokens
    assert got.usage["prompt_tokens"] == expected.usage["prompt_tokens"]
    assert got.usage["completion_tokens"] == MAX_TOKENS
    assert got.finish_reasons == ["length"] and not got.errors
    assert _metric(url, "splitserve:request_migrations_total") == {"worker_unavailable": 1.0}
    survivors = [w for w in [*prefill, *decode] if w not in stopped]
    wait_blocks_free(*survivors)
