"""`serve --autoscale` on the real cluster and the real model: a burst of requests grows the prefill pool, the
grown pool serves, and quiet shrinks it back; the decisions are logged with their reasons and counted.

Windows and cool-downs are seconds here (a 0.05 s TTFT SLO every CPU burst breaks, a 2 s window, a 4 s down
cool-down), so the whole cycle fits in the time one serve start takes.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.load import burst
from tests.deploy.processes import ServeProcess, serve_argv, serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def _gauge(url: str, name: str, **labels: str) -> float:
    return _samples(url, name)[tuple(sorted(labels.items()))]


def _wait_for(check, what: str, serve: ServeProcess, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert serve.proc.poll() is None and time.monotonic() < deadline, f"{what}:\n{serve.output()}"
        time.sleep(0.2)


def test_a_burst_grows_the_prefill_pool_and_quiet_shrinks_it(smollm2_gguf: str, tmp_path: Path) -> None:
    argv = serve_argv(
        smollm2_gguf, "--max-model-len", "128", "--num-kv-blocks", "64", "--no-prefix-index",  # small workers: 3 at once
        "--disagg-prefill-threshold", "0",  # every prompt through a prefill worker
        "--autoscale", "--prefill-workers-min", "1", "--prefill-workers-max", "2",
        "--decode-workers-min", "1", "--decode-workers-max", "1", "--ttft-slo", "0.05", "--tpot-slo", "30",
        "--autoscale-window", "2", "--autoscale-interval", "0.25", "--scale-up-cooldown", "1",
        "--scale-down-cooldown", "4")
    stderr = tmp_path / "stderr.txt"
    with serving(argv, stderr_path=stderr) as serve:
        url = serve.url
        assert _gauge(url, "splitserve:pool_num_workers", pool="prefill") == 1

        outcomes = burst(url, smollm2_gguf, num_requests=8, max_tokens=2)
        assert all(o.status == 200 and o.completed for o in outcomes), [o.error for o in outcomes]
        _wait_for(lambda: _gauge(url, "splitserve:pool_num_workers", pool="prefill") == 2, "no scale-up", serve)

        # The grown pool serves: a second burst reaches the new prefill worker too (routing by load).
        outcomes = burst(url, smollm2_gguf, num_requests=8, max_tokens=2)
        assert all(o.status == 200 and o.completed for o in outcomes), [o.error for o in outcomes]
        transfers = _samples(url, "splitserve:kv_transfers_total")
        assert transfers[(("worker", "prefill-1"),)] > 0, transfers

        _wait_for(lambda: _gauge(url, "splitserve:pool_num_workers", pool="prefill") == 1, "no scale-down", serve)
        decisions = _samples(url, "splitserve:autoscaler_decisions_total")
        assert decisions == {(("direction", d), ("pool", p)): (1.0 if p == "prefill" else 0.0)
                             for p in ("prefill", "decode") for d in ("up", "down")}
        assert _gauge(url, "splitserve:pool_num_workers", pool="decode") == 1
        _wait_for(lambda: not any(_samples(url, "splitserve:kv_blocks_used").values()), "KV blocks still used", serve)

        log = stderr.read_text(errors="replace")
        (grown,) = [line for line in log.splitlines() if "router.autoscaler: prefill 1 -> 2 workers: " in line]
        assert "> SLO 0.05 s" in grown or "requests waiting on 1 workers" in grown, grown  # TTFT or queue pressure
        assert "router.autoscaler: prefill 2 -> 1 workers: idle (no TTFT sample) for " in log
