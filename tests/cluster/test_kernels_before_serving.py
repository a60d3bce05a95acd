"""`splitserve serve` on a machine whose kernel cache is empty: the C++ CPU kernels are built once, in the parent,
before any worker starts; the workers only load them; the first request after /health turns 200 costs what the
next ones do; /metrics says which variant every worker runs.
"""

from __future__ import annotations

import re
import signal
import statistics
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_transfer import native_build
from tests.deploy.processes import ServeProcess, get_status, stop_and_check

pytestmark = [pytest.mark.slow, pytest.mark.ray]

KERNELS = {"cpu_elementwise", "cpu_paged_attention", "block_copy"}
PROMPTS = ["The capital of France is", "The largest ocean on Earth", "My favourite colour is",
           "The best way to learn is", "Once upon a time there"]


def _timed_completion(client: httpx.Client, model: str, prompt: str) -> float:
    started_s = time.perf_counter()
    response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                    "temperature": 0, "ignore_eos": True})
    elapsed_s = time.perf_counter() - started_s
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16
    return elapsed_s


def test_kernels_are_built_before_the_workers_start_and_the_first_request_is_not_slow(smollm2_gguf, tmp_path):
    variant, reason = native_build.selected_variant()
    expected = variant.name if variant is not None else native_build.FALLBACK
    argv = [sys.executable, "-m", "deploy.cli", "serve", "--model", smollm2_gguf, "--port", "0", "--kv-cache-memory", "256MiB", "--max-model-len", "1024"]
    stderr_path = tmp_path / "stderr.txt"
    serve = ServeProcess(argv, stderr_path=stderr_path,
                         env={native_build.KERNEL_CACHE_ENV: str(tmp_path / "kernels")})  # an empty cache
    try:
        url = serve.wait_ready(600)
        assert get_status(f"{url}/health") == 200
        with httpx.Client(base_url=url, timeout=120) as client:
            first_s = _timed_completion(client, smollm2_gguf, PROMPTS[0])
            later_s = [_timed_completion(client, smollm2_gguf, prompt) for prompt in PROMPTS[1:]]
            metrics = client.get("/metrics").text
        log = stderr_path.read_text(errors="replace")

        if variant is not None:
            # Built in the parent (build-kernels' report), each once, before the ready line; no worker compiled.
            built = re.findall(r"^(\w+) \((\S+)\): built in", log, flags=re.MULTILINE)
            assert sorted(built) == sorted((kernel, expected) for kernel in KERNELS), log[-4000:]
            assert "built C++ CPU kernel" not in log, "a worker compiled a kernel"
        # Each worker's start-up log names each kernel and the variant it loaded.
        loaded = re.findall(r"C\+\+ CPU kernels: (.*)$", log, flags=re.MULTILINE)
        assert len(loaded) == 2, log[-4000:]  # one prefill and one decode worker
        for line in loaded:
            for kernel in KERNELS:
                assert f"{kernel}={expected}" in line or f"{kernel}=torch ops" in line and variant is None, line

        info = [s for family in text_string_to_metric_families(metrics) for s in family.samples
                if s.name == "splitserve:cpu_kernels_info"]
        assert {(s.labels["worker"], s.labels["kernel"], s.labels["variant"]) for s in info} == {
            (worker, kernel, expected) for worker in ("prefill-0", "decode-0") for kernel in KERNELS}

        # A kernel compiled on the request path costs 20+ s; loading the model's first step, nothing like it.
        typical_s = statistics.median(later_s)
        assert first_s < max(2.0 * typical_s, typical_s + 1.0), (first_s, later_s)
        stop_and_check(serve, [signal.SIGINT], expect_code=0)
    finally:
        serve.close()
