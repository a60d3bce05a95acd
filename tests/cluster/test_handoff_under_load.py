"""KV handoffs on a busy machine: real workers (real engines on the real model, real gRPC, a real KV handoff)
behind the real gateway app, the decode worker's engine slowed as a saturated CPU slows it.

A handoff that fails is retried by the gateway at once, under the same request id, and with one prefill worker to
the same pair. On a busy machine the engine thread runs what it is asked a step later, so whatever the failed
attempt left queued on the engine (its abort) runs after the retry has begun: the retry must not meet it.
`SPLITSERVE_FAULT_STEP_SLEEP_S` makes each decode step take long, as on a saturated CPU, and a stream kept running
beside keeps the engine stepping; `SPLITSERVE_FAULT_KV_CUTS` cuts the first handoffs half-way.

(Found on a fresh 2-vCPU VM, where the suite's other worker kept both cores busy: the chat request of
tests/cluster/test_serve_openai.py, whose handoff that file's fault cuts, got 503 "the worker aborted the
request" from its retry, which had read the failed attempt's final "abort" output.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine.request.sampling_params import SamplingParams
from prefill_worker.worker import FAULT_KV_CUTS_ENV
from protos import serving_pb2
from protos.worker_info import WorkerInfo
from router.app import create_app
from router.config import RouterConfig
from router.server import RouterServer
from router.worker_registry import WorkerRegistry
from tests.cluster.worker_harness import engine_config, start_worker, stub, wait_blocks_free
from worker.runtime import FAULT_STEP_SLEEP_ENV

pytestmark = [pytest.mark.slow]

MODEL = "smollm2-135m"
PROMPT = "Write a short story about a lighthouse keeper and the sea. " * 4  # 48 tokens: 3 blocks, so it can be cut
MAX_TOKENS = 8
# Before each decode step. The gateway's retry reaches the decode worker a few milliseconds after the failed
# attempt ends, while what that attempt queued on the engine waits for the step in flight: up to this long.
STEP_SLEEP_S = 0.25
ENGINE = {"num_threads": 1, "num_kv_blocks": 64}


def _metric(url: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {next(iter(s.labels.values()), ""): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


@pytest.fixture
def start_gateway(smollm2_checkpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[str, list]]]:
    """`start_gateway(num_cuts=, step_sleep_s=)`: the gateway's URL and its workers, a prefill worker that cuts its
    first `num_cuts` handoffs of 2+ blocks and a decode worker whose every step sleeps `step_sleep_s` first."""
    started: list = []

    def start(*, num_cuts: int, step_sleep_s: float = 0.0) -> tuple[str, list]:
        monkeypatch.setenv(FAULT_KV_CUTS_ENV, str(num_cuts))
        prefill = start_worker("prefill", smollm2_checkpoint, worker_id="prefill-0", **ENGINE)
        started.append(prefill)
        monkeypatch.delenv(FAULT_KV_CUTS_ENV)
        monkeypatch.setenv(FAULT_STEP_SLEEP_ENV, str(step_sleep_s))
        decode = start_worker("decode", smollm2_checkpoint, worker_id="decode-0", **ENGINE)
        started.append(decode)
        infos = [WorkerInfo(worker_id=w.worker_id, role=w.role, endpoint=w.endpoint) for w in (prefill, decode)]
        config = RouterConfig(served_model_names=(MODEL,), max_model_len=1024)
        registry = WorkerRegistry(lambda: infos, refresh_interval_s=0.3, load_timeout_s=5.0)
        server = RouterServer(create_app(config, registry, smollm2_checkpoint.tokenizer)).start()
        started.insert(0, server)
        return server.url, [prefill, decode]

    try:
        yield start
    finally:
        for each in started:
            each.stop()


@pytest.fixture(scope="module")
def expected(smollm2_checkpoint) -> str:
    """PROMPT's greedy completion by the offline engine."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(), smollm2_checkpoint)
    engine.add_request("ref", smollm2_checkpoint.tokenizer.encode(PROMPT),
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.text
    raise AssertionError("unreachable")


def test_a_cut_handoff_retried_while_the_decode_engine_is_busy_gets_its_greedy_answer(start_gateway,
                                                                                      expected) -> None:
    url, workers = start_gateway(num_cuts=1, step_sleep_s=STEP_SLEEP_S)
    decode = workers[1]
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    stop_beside = threading.Event()

    def stream_beside() -> None:  # a 1-block prompt, whose handoff is not cut; read until told to stop
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={**body, "prompt": "Count to a thousand:", "max_tokens": 1000, "stream": True}) as r:
            for _ in r.iter_lines():
                if stop_beside.is_set():
                    return  # the client leaves: the gateway aborts the stream

    beside = threading.Thread(target=stream_beside)
    beside.start()
    try:
        while not stub(decode).GetLoad(serving_pb2.LoadRequest(), timeout=10).num_requests_running:
            assert beside.is_alive(), "the stream beside ended before it ran"
            time.sleep(0.01)
        response = httpx.post(f"{url}/v1/completions", timeout=120,
                              json={**body, "prompt": PROMPT, "max_tokens": MAX_TOKENS})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
    finally:
        stop_beside.set()
        beside.join(timeout=60)
    assert _metric(url, "splitserve:request_retries_total") == {"aborted": 1}  # it was cut, and retried
    assert not _metric(url, "splitserve:request_failure_total")
    wait_blocks_free(*workers)


def test_a_handoff_failing_on_every_attempt_says_why_in_the_503_and_the_failure_count(start_gateway) -> None:
    url, workers = start_gateway(num_cuts=2)  # the first attempt's and the retry's handoffs
    response = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("the KV handoff failed on the last of 2 attempts (kv_transfer_failed): "), message
    assert "handoff cut after" in message  # the sender's own words
    assert _metric(url, "splitserve:request_failure_total") == {"kv_transfer_failed": 1}
    wait_blocks_free(*workers)
