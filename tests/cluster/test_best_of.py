"""`best_of` through the gateway over a real 1 prefill + 1 decode cluster (real engines on the real model, real
gRPC, every prompt's KV handed off): the choices returned are the `n` of highest cumulative logprob among the
`best_of` the engine generated, best first, judged by the offline engine's own logprobs of the same seeded
sequences (a seeded choice samples on two workers what it samples on one: tests/cluster/test_workers.py); with
`stream` it is a 400. Every KV block is free afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from engine.request.sampling_params import SamplingParams
from protos.worker_info import WorkerInfo
from router.app import create_app
from router.config import RouterConfig
from router.server import RouterServer
from router.worker_registry import WorkerRegistry
from tests.cluster.worker_harness import engine_config, start_worker, wait_blocks_free

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPT = "My favourite thing to do on a rainy afternoon is"
SAMPLING = dict(temperature=1.0, seed=2024, max_tokens=8, ignore_eos=True)
N, BEST_OF = 2, 5


@dataclass(frozen=True)
class Candidate:
    index: int
    text: str
    cumulative_logprob: float  # the engine's own: the sum of its sampled tokens' logprobs


@pytest.fixture(scope="module")
def cluster(smollm2_checkpoint) -> Iterator[tuple[str, list]]:
    workers = [start_worker("prefill", smollm2_checkpoint, worker_id="prefill-0"),
               start_worker("decode", smollm2_checkpoint, worker_id="decode-0")]
    infos = [WorkerInfo(worker_id=w.worker_id, role=w.role, endpoint=w.endpoint, incarnation=w.incarnation)
             for w in workers]
    config = RouterConfig(served_model_names=(MODEL,), max_model_len=1024)
    registry = WorkerRegistry(lambda: infos, refresh_interval_s=0.3, load_timeout_s=5.0)
    server = RouterServer(create_app(config, registry, smollm2_checkpoint.tokenizer)).start()
    try:
        yield server.url, workers
    finally:
        server.stop()
        for worker in workers:
            worker.stop()


@pytest.fixture(scope="module")
def candidates(smollm2_checkpoint) -> list[Candidate]:
    """The offline engine's `best_of` sequences of PROMPT on the same seed, best first (cumulative logprob)."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(), smollm2_checkpoint)
    engine.add_request("ref", smollm2_checkpoint.tokenizer.encode(PROMPT),
                       SamplingParams(n=N, best_of=BEST_OF, logprobs=0, **SAMPLING))  # type: ignore[arg-type]
    found = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.logprobs is not None and len(out.logprobs) == SAMPLING["max_tokens"], out
                found.append(Candidate(out.index, out.text, sum(lp.logprob for lp in out.logprobs)))
    assert sorted(c.index for c in found) == list(range(BEST_OF))
    return sorted(found, key=lambda c: -c.cumulative_logprob)


def _complete(url: str, **fields: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": PROMPT, "n": N, "best_of": BEST_OF, **SAMPLING, **fields})


def test_best_of_returns_the_n_choices_of_highest_cumulative_logprob(cluster, candidates) -> None:
    url, workers = cluster
    scores = [c.cumulative_logprob for c in candidates]
    # The seed makes this a test: the best are not the first n generated, and no near-tie decides the order.
    assert [c.index for c in candidates[:N]] != list(range(N)), candidates
    assert len({c.text for c in candidates}) == BEST_OF and min(a - b for a, b in zip(scores, scores[1:])) > 1e-2

    plain = _complete(url)  # no logprobs asked for: the router asks the workers for them, to rank the sequences
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert [c["text"] for c in body["choices"]] == [c.text for c in candidates[:N]], (body, candidates)
    assert [c["index"] for c in body["choices"]] == list(range(N))
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["completion_tokens"] == N * SAMPLING["max_tokens"]  # the choices returned, as vLLM

    with_logprobs = _complete(url, logprobs=1)
    assert with_logprobs.status_code == 200, with_logprobs.text
    returned = with_logprobs.json()["choices"]
    assert [c["text"] for c in returned] == [c.text for c in candidates[:N]]
    for choice, candidate in zip(returned, candidates, strict=False):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == SAMPLING["max_tokens"]
        assert sum(token_logprobs) == pytest.approx(candidate.cumulative_logprob, abs=1e-3)
    wait_blocks_free(*workers)


def test_best_of_with_stream_is_a_400(cluster) -> None:
    url, workers = cluster
    response = _complete(url, stream=True)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "best_of" and "stream" in error["message"], error
    wait_blocks_free(*workers)
