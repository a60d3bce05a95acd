"""Busy is not dead: a worker whose engine is slow (every step sleeps longer than the router's load poll and the
controller's health check wait) keeps serving and is never restarted. (A worker whose process is killed is
restarted within the configured health-check interval and threshold: tests/cluster/test_pool_scaling.py kills one
mid-stream.)

Against a real `splitserve serve` (real Ray, real workers, the real model), with fast health checks.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.processes import serve_argv, serving
from worker.runtime import FAULT_STEP_SLEEP_ENV

pytestmark = [pytest.mark.slow, pytest.mark.ray]

HEALTH_FLAGS = ["--health-check-interval", "0.5", "--health-check-timeout", "1", "--health-check-failure-threshold",
                "2"]


def _metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def _restarts(url: str) -> dict[tuple[str, str], float]:
    return {(dict(k)["role"], dict(k)["reason"]): v for k, v in _metric(url, "splitserve:worker_restarts_total").items()}


def _complete(url: str, model: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Once upon a time",
                                                      "max_tokens": max_tokens, "ignore_eos": True},
                      timeout=120)


def test_a_slow_engine_keeps_serving_and_is_not_restarted(smollm2_gguf, tmp_path) -> None:
    argv = serve_argv(smollm2_gguf, "--max-model-len", "256", *HEALTH_FLAGS)
    # 4 s per step: the health check (1 s timeout) is answered apart from the engine, and the router's load poll
    # (2 s timeout) while the step runs (GetLoad reads the engine's stats under its lock, which a step lets go of
    # while it computes; answered between steps, as before 2026-11-28, a poll in a step's first half timed out).
    with serving(argv, stderr_path=tmp_path / "stderr.txt", env={FAULT_STEP_SLEEP_ENV: "4"}) as serve:
        url = serve.url
        started = time.monotonic()
        # A prefill step, then a decode step: 8 s busy, twice the time in which the health checks would have
        # failed twice (the threshold) had the engine kept them waiting.
        response = _complete(url, smollm2_gguf, 2)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        assert time.monotonic() - started > 7  # the engine really was slow
        log = (tmp_path / "stderr.txt").read_text(errors="replace")
        assert "load poll timed out" not in log  # the router's polls were answered during the slow steps ...
        assert all(v == 0 for v in _restarts(url).values()), _restarts(url)  # ... and nobody was restarted
        assert "restarted" not in log
        healthy = _metric(url, "splitserve:worker_healthy")
        assert healthy and all(v == 1 for v in healthy.values()), healthy
