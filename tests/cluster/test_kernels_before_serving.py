"""`splitserve serve` end to end, on a machine whose kernel cache lacks a kernel: the missing C++ CPU kernel is
built once, in the parent, before any worker starts, and the cached ones are not rebuilt; the workers only load
them; the first request after /health turns 200 costs what the next ones do; /metrics says which variant every
worker runs; the embedded Redis prefix index is up and both workers publish to it; SIGINT leaves nothing running.

The cache starts with this machine's builds of every kernel but one (`deploy/setup.sh` made them): the four cost
~100 CPU-s to compile, and one is as good a witness of "built before the workers start" as four.
"""

from __future__ import annotations

import re
import shutil
import statistics
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_transfer import native_build
from tests.deploy.processes import get_status, serve_argv, serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]

KERNELS = {"cpu_elementwise", "cpu_paged_attention", "cpu_quantized_linear", "block_copy"}
PROMPTS = ["The capital of France is", "The largest ocean on Earth", "My favourite colour is",
           "The best way to learn is", "Once upon a time there"]


UNBUILT = "block_copy"  # the kernel the test's cache lacks; the others are copied from the machine's cache


def _seed_cache(cache: Path, variant: native_build.Variant) -> set[str]:
    """Copy this machine's complete builds of every kernel but UNBUILT into the empty cache `cache`; the kernels
    copied (none where the machine's cache lacks them, e.g. set-up could not compile)."""
    from engine.kernels.registry import native_modules

    seeded = set()
    for module in native_modules():
        built = native_build.complete_build(module, variant)  # the machine's cache: the env var is not set yet
        if module.name == UNBUILT or built is None:
            continue
        shutil.copytree(built, cache / built.parent.name / built.name)
        seeded.add(module.name)
    return seeded


def _timed_completion(client: httpx.Client, model: str, prompt: str) -> float:
    started_s = time.perf_counter()
    response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                    "temperature": 0, "ignore_eos": True})
    elapsed_s = time.perf_counter() - started_s
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16
    return elapsed_s


def test_serve_builds_missing_kernels_before_the_workers_start_and_serves_end_to_end(smollm2_gguf, tmp_path):
    variant, reason = native_build.selected_variant()
    expected = variant.name if variant is not None else native_build.FALLBACK
    seeded = _seed_cache(tmp_path / "kernels", variant) if variant is not None else set()
    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--kv-cache-memory", "256MiB",
                      "--max-model-len", "1024")
    stderr_path = tmp_path / "stderr.txt"
    with serving(argv, stderr_path=stderr_path, env={native_build.KERNEL_CACHE_ENV: str(tmp_path / "kernels")},
                 ready_timeout_s=600) as serve:
        url = serve.url
        assert get_status(f"{url}/health") == 200
        with httpx.Client(base_url=url, timeout=120) as client:
            first_s = _timed_completion(client, smollm2_gguf, PROMPTS[0])
            later_s = [_timed_completion(client, smollm2_gguf, prompt) for prompt in PROMPTS[1:]]
            metrics = client.get("/metrics").text
        log = stderr_path.read_text(errors="replace")

        if variant is not None:
            # Built in the parent (build-kernels' report), each once, before the ready line; no worker compiled.
            built = re.findall(r"^(\w+) \((\S+)\): built in", log, flags=re.MULTILINE)
            assert sorted(built) == sorted((kernel, expected) for kernel in KERNELS - seeded), log[-4000:]
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

        # The embedded redis-server is up and both workers publish to it (it goes with serve: leaving `serving`
        # finds nothing of serve's left running, redis-server included).
        deadline = time.monotonic() + 30
        while True:
            index = httpx.get(f"{url}/v1/prefix_index", timeout=10).json()
            if index["up"] and {w["worker_id"] for w in index["workers"] if w["live"]} == {"prefill-0", "decode-0"}:
                break
            assert time.monotonic() < deadline, index
            time.sleep(0.2)
        assert index["routing_policy"] == "prefix-aware" and index["namespace"]["model"].startswith("sha256:")
