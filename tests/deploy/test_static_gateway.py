"""`splitserve gateway --prefill HOST:PORT --decode HOST:PORT` over real worker processes (`python -m prefill_worker`,
`python -m decode_worker`: real model, real gRPC, a cluster secret), with Ray unimportable in the gateway.

- The gateway takes the model, its context length and the workers' own ids from the workers' Health answers.
- Greedy completion and streamed chat equal the decode worker's own Generate of the same prompt (prefilled there,
  no handoff): disaggregated through the gateway (a KV handoff for every prompt) gives the very same text.
- /metrics carries the usual splitserve: metrics, labelled with the workers' ids; the admin API lists the fixed
  pools and refuses to scale them.
- After the requests and a stream the client drops, every KV block of both workers is free (their GetLoad).
- A gateway without the workers' secret, or with the roles swapped, is refused at start; SIGINT stops the gateway
  (exit 0), SIGTERM the workers (exit 0); the gateway never tried to import ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine.request.sampling_params import SamplingParams
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import ClusterAuth, sync_channel
from tests.cluster.test_serve_openai import wait_until_every_block_is_free
from tests.cluster.worker_harness import generate
from tests.deploy.processes import (
    REPO_ROOT,
    TEST_KV_CACHE_MEMORY,
    WORKER_READY,
    ServeProcess,
)

pytestmark = pytest.mark.slow

SECRET = "static-gateway-test-secret"
MAX_TOKENS = 16
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a famous river."}]
ADMIN_TOKEN = "static-admin"
NO_RAY = 'import os\nopen(os.environ["RAY_IMPORT_MARKER"], "w").close()\nraise ImportError("no ray here (test shim)")\n'


@dataclass
class Cluster:
    url: str
    prefill: ServeProcess
    decode: ServeProcess
    gateway: ServeProcess
    gateway_env: dict[str, str]
    ray_marker: Path
    tmp: Path

    def stub(self, worker: ServeProcess) -> serving_pb2_grpc.WorkerStub:
        assert worker.url is not None
        return serving_pb2_grpc.WorkerStub(sync_channel(worker.url, ClusterAuth(secret=SECRET)))


def _worker(module: str, model: str, tmp: Path, *flags: str) -> ServeProcess:
    argv = [sys.executable, "-m", module, "--model", model, "--kv-cache-memory", TEST_KV_CACHE_MEMORY,
            "--max-model-len", "1024", "--num-threads", "1", *flags]
    return ServeProcess(argv, stderr_path=tmp / f"{module}.stderr", ready=WORKER_READY,
                        env={"SPLITSERVE_CLUSTER_SECRET": SECRET})


def _gateway_argv(prefill: str, decode: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "gateway", "--prefill", prefill, "--decode", decode, "--port", "0",
            "--worker-wait-timeout", "120", *flags]


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("static")
    (tmp / "no_ray" / "ray").mkdir(parents=True)
    (tmp / "no_ray" / "ray" / "__init__.py").write_text(NO_RAY)
    marker = tmp / "ray_imported"
    gateway_env = {"PYTHONPATH": f"{tmp / 'no_ray'}:{REPO_ROOT}", "RAY_IMPORT_MARKER": str(marker),
                   "SPLITSERVE_CLUSTER_SECRET": SECRET}
    prefill = _worker("prefill_worker", smollm2_gguf, tmp)
    decode = _worker("decode_worker", smollm2_gguf, tmp)
    gateway = None
    try:
        p, d = prefill.wait_ready(300), decode.wait_ready(300)
        # --disagg-prefill-threshold 0: every prompt's KV goes through the handoff
        gateway = ServeProcess(_gateway_argv(p, d, "--disagg-prefill-threshold", "0", "--admin-token", ADMIN_TOKEN),
                               stderr_path=tmp / "gateway.stderr", env=gateway_env)
        url = gateway.wait_ready(120)
        yield Cluster(url=url, prefill=prefill, decode=decode, gateway=gateway, gateway_env=gateway_env,
                      ray_marker=marker, tmp=tmp)
        assert gateway.proc.poll() is None, f"the gateway died meanwhile:\n{gateway.output()}"
        gateway.proc.send_signal(signal.SIGINT)
        assert gateway.proc.wait(60) == 0, gateway.output()
        for worker in (prefill, decode):
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.proc.wait(60) == 0, worker.output()
        assert not marker.exists(), "the fixed-list gateway imported ray"
    finally:
        for process in (gateway, prefill, decode):
            if process is not None:
                process.close()


def _own_generate(cluster: Cluster, prompt_ids: list[int]) -> str:
    """The decode worker's own greedy answer: it prefills the prompt itself (no prefill endpoint, no handoff)."""
    result = generate(cluster.stub(cluster.decode), f"own-{time.monotonic_ns()}", prompt_ids,
                      SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert not result.error and (len(result.token_ids) == MAX_TOKENS or result.finish_reason == "stop"), result
    return result.text


def test_the_openai_api_over_the_fixed_list(cluster: Cluster, smollm2_gguf: str) -> None:
    from router.server import load_tokenizer

    tok, _ = load_tokenizer(smollm2_gguf)
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    models = client.models.list().data
    assert [m.id for m in models] == [smollm2_gguf]
    assert models[0].model_extra["max_model_len"] == 1024  # the workers' --max-model-len, not the model's 8192

    completion = client.completions.create(model=smollm2_gguf, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == _own_generate(cluster, tok.encode(PROMPT))

    stream = client.chat.completions.create(model=smollm2_gguf, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    streamed = [c.choices[0].delta.content or "" for c in stream if c.choices]
    chat_ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)
    assert len(streamed) > 2 and "".join(streamed) == _own_generate(cluster, chat_ids)

    # the usual metrics, labelled with the workers' own ids (their Health answers), every block free after
    metrics = wait_until_every_block_is_free(cluster.url)
    workers = {h.worker_id for h in _healths(cluster)}
    assert set(metrics["splitserve:kv_blocks_used"]) == workers
    assert metrics["splitserve:worker_healthy"] == dict.fromkeys(workers, 1.0)
    assert metrics["splitserve:time_to_first_token_seconds_count"][""] >= 2
    assert metrics["splitserve:kv_transfer_bytes_total"][next(w for w in workers if w.startswith("prefill"))] > 0
    assert "splitserve:request_success_total" in metrics and "splitserve:e2e_request_latency_seconds_count" in metrics


def _healths(cluster: Cluster) -> list[serving_pb2.HealthResponse]:
    return [cluster.stub(w).Health(serving_pb2.HealthRequest(), timeout=10) for w in (cluster.prefill, cluster.decode)]


def test_a_dropped_stream_frees_every_block_and_the_pools_are_fixed(cluster: Cluster, smollm2_gguf: str) -> None:
    body = {"model": smollm2_gguf, "prompt": PROMPT * 8, "max_tokens": 400, "temperature": 0.8, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break  # the client goes away mid-stream
        pools = http.get("/admin/pools", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).json()["workers"]
        scaled = http.post("/admin/scale", json={"decode": 2}, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert {(w["role"], w["endpoint"], w["state"]) for w in pools} == {
        ("prefill", cluster.prefill.url, "serving"), ("decode", cluster.decode.url, "serving")}
    healths = _healths(cluster)
    assert {w["incarnation"] for w in pools} == {h.incarnation for h in healths}
    assert [h.quantization for h in healths] == ["none", "none"]  # Health names the workers' --quantization
    assert scaled.status_code == 503 and "fixed worker list" in scaled.json()["error"]["message"]

    deadline = time.monotonic() + 30
    while True:  # the workers' own counts: every block free, nothing running or waiting
        loads = [cluster.stub(w).GetLoad(serving_pb2.LoadRequest(), timeout=10) for w in (cluster.prefill,
                                                                                           cluster.decode)]
        if all(s.kv_blocks_used == 0 and s.num_requests_running == s.num_requests_waiting == 0 for s in loads):
            break
        assert time.monotonic() < deadline, [(s.worker_id, s.kv_blocks_used, s.num_requests_running) for s in loads]
        time.sleep(0.5)
    assert all(s.kv_blocks_free == s.kv_blocks_total > 0 for s in loads)
    wait_until_every_block_is_free(cluster.url)  # and the gateway's /metrics says so


def test_a_gateway_without_the_secret_or_with_swapped_roles_is_refused(cluster: Cluster) -> None:
    assert cluster.prefill.url is not None and cluster.decode.url is not None
    env = {**os.environ, **cluster.gateway_env, "SPLITSERVE_CLUSTER_SECRET": ""}
    no_secret = subprocess.run(_gateway_argv(cluster.prefill.url, cluster.decode.url), cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=60, check=False)
    assert no_secret.returncode == 1, no_secret.stderr
    assert "refused this gateway's cluster secret" in no_secret.stderr
    swapped = subprocess.run(_gateway_argv(cluster.decode.url, cluster.prefill.url), cwd=REPO_ROOT,
                             env={**os.environ, **cluster.gateway_env}, capture_output=True, text=True, timeout=60, check=False)
    assert swapped.returncode == 2, swapped.stderr
    assert f"--prefill {cluster.decode.url}: that worker" in swapped.stderr and "give it as --decode" in swapped.stderr
