"""`splitserve serve` with pools of different tensor-parallel sizes (real Ray, real workers on the real SmolLM2, real
gRPC, a real KV handoff): prefill TP 3 → decode TP 1.

- a greedy completion equals the offline TP 1 engine's;
- /admin/pools lists each worker's ranks, every one a live process under `serve`; /metrics labels each rank;
- a SIGKILLed prefill rank makes the worker dead: the controller restarts it whole (a new incarnation, three new
  rank processes, the old ones gone), and the next request gets the same answer.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.deploy.processes import descendants, serve_argv, serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "The lighthouse keeper climbed the stairs at dusk, and"
MAX_TOKENS = 12


def _pools(url: str) -> dict[str, dict]:
    response = httpx.get(f"{url}/admin/pools", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return {w["role"]: w for w in response.json()["workers"]}


def _complete(url: str, model: str) -> str:
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_pools_of_different_tensor_parallel_sizes_serve_and_a_dead_rank_restarts_its_worker(
        smollm2_gguf: str, smollm2_checkpoint, tmp_path) -> None:  # noqa: ANN001
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    offline = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=256), smollm2_checkpoint)
    offline.add_request("ref", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    expected = next(out.text for _ in range(100) for out in offline.step() if out.finished)

    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--admin-token", TOKEN,
                      "--max-model-len", "256",
                      "--prefill-tensor-parallel-size", "3", "--decode-tensor-parallel-size", "1",
                      "--disagg-prefill-threshold", "0",  # every prompt through the prefill worker
                      "--health-check-interval", "0.5", "--health-check-timeout", "2",
                      "--health-check-failure-threshold", "2")
    with serving(argv, stderr_path=tmp_path / "stderr.txt") as serve:
        assert _complete(serve.url, smollm2_gguf) == expected
        pools = _pools(serve.url)
        prefill, decode = pools["prefill"], pools["decode"]
        assert len(prefill["rank_pids"]) == 3 and decode["rank_pids"] == [decode["pid"]]
        assert set(prefill["rank_pids"]) <= set(descendants(serve.proc.pid))
        ranks = {s.labels["rank"] for s in _samples(serve.url, "splitserve:worker_rank_weight_bytes")
                 if s.labels["worker"] == prefill["worker_id"]}
        assert ranks == {"0", "1", "2"}

        os.kill(prefill["rank_pids"][2], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            now = _pools(serve.url).get("prefill")
            if (now and now["state"] == "serving" and now["incarnation"] != prefill["incarnation"]
                    and now["load"] is not None and now["load"]["healthy"]):  # and the gateway has polled it
                break
            assert time.monotonic() < deadline, f"the prefill worker was not restarted: {now}"
            time.sleep(0.5)
        assert len(now["rank_pids"]) == 3 and not set(now["rank_pids"]) & set(prefill["rank_pids"])
        alive = descendants(serve.proc.pid)
        assert not set(prefill["rank_pids"]) & set(alive), "a rank of the dead worker outlived it"
        assert _complete(serve.url, smollm2_gguf) == expected


def _samples(url: str, name: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
