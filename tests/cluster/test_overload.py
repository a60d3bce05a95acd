"""`splitserve serve` at several times its capacity: it slows down and refuses what it cannot queue, it never falls
over.

Per pool shape (1 prefill + 1 decode worker, then 2 + 2), against the real cluster and the real model, each
decode worker running at most 64 requests at once (--max-num-seqs), so the gateway admits 64 per decode worker and
queues as many again:
- 500 concurrent streamed completions (short prompts, 16 tokens each): every response is a 200 whose stream
  finished, or a 429 with Retry-After; nothing else (no 5xx, no connection error); at least 100 are served, and
  some refused;
- no worker was restarted (`splitserve:worker_restarts_total` all 0) and every worker's KV blocks are free after;
- then 20 more requests, all served.

One cluster for both shapes (a serve start is most of what a shape costs): it starts 1 + 1 and grows to 2 + 2
through the admin API, as an operator would; the gateway's capacity follows the pool's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.load import burst
from tests.deploy.processes import serve_argv, serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TOKEN = "test-admin-token"
MAX_NUM_SEQS = 64  # per decode worker; 1 + 1 then serves 2 x 64 of the 500, 2 + 2 2 x 128


def _samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def _rejected(url: str) -> dict[str, float]:
    return {labels["reason"]: value for labels, value in _samples(url, "splitserve:admission_rejections_total")}


def _burst_of_500(url: str, model: str) -> int:
    """500 at once: served or refused, nothing else; no restart; every block free after; then 20 more served. The
    number served."""
    rejected_before = _rejected(url)
    outcomes = burst(url, model, num_requests=500, max_tokens=16)
    counts = collections.Counter((o.status, o.completed) for o in outcomes)
    assert set(counts) == {(200, True), (429, False)}, (counts, {o.error for o in outcomes if o.error})
    assert counts[(200, True)] >= 100, counts
    assert all(o.num_tokens == 16 for o in outcomes if o.status == 200)

    restarts = _samples(url, "splitserve:worker_restarts_total")
    assert restarts and all(value == 0 for _, value in restarts), restarts
    deadline = time.monotonic() + 30
    while any(value for _, value in _samples(url, "splitserve:kv_blocks_used")):
        assert time.monotonic() < deadline, _samples(url, "splitserve:kv_blocks_used")
        time.sleep(0.5)
    rejected = _rejected(url)
    assert rejected["queue_full"] - rejected_before.get("queue_full", 0) == counts[(429, False)]
    assert rejected["queue_timeout"] == 0

    after = burst(url, model, num_requests=20, max_tokens=16)
    assert all(o.status == 200 and o.completed for o in after), [o.error for o in after if o.error]
    return counts[(200, True)]


def test_500_concurrent_requests_are_served_or_refused_and_nothing_falls_over(smollm2_gguf, tmp_path):
    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--max-model-len", "256",
                      "--max-num-seqs", str(MAX_NUM_SEQS), "--admin-token", TOKEN,
                      "--disagg-prefill-threshold", "0")  # every request through a prefill worker and a KV handoff
    with serving(argv, stderr_path=tmp_path / "stderr.txt") as serve:
        url = serve.url
        _burst_of_500(url, smollm2_gguf)  # 1 prefill + 1 decode

        auth = {"Authorization": f"Bearer {TOKEN}"}
        grown = httpx.post(f"{url}/admin/scale", headers=auth, json={"prefill": 2, "decode": 2}, timeout=300)
        assert grown.status_code == 200, grown.text

        def every_worker_polled() -> bool:  # the gateway's capacity comes from these loads
            workers = httpx.get(f"{url}/admin/pools", headers=auth, timeout=30).json()["workers"]
            return len(workers) == 4 and all(w["load"] and w["load"]["healthy"] for w in workers)

        deadline = time.monotonic() + 60
        while not every_worker_polled():
            assert time.monotonic() < deadline, httpx.get(f"{url}/admin/pools", headers=auth, timeout=30).text
            time.sleep(0.5)
        served = _burst_of_500(url, smollm2_gguf)  # 2 prefill + 2 decode
        assert served > 2 * MAX_NUM_SEQS, served  # more than 1 + 1 runs and queues: the gateway saw the new workers


@pytest.mark.parametrize("admission", ["--admission-control", "--no-admission-control"])
def test_a_small_decode_pool_serves_every_request_without_deadlock(smollm2_gguf, tmp_path, admission) -> None:
    """Issue 15's reproduction: 12 KV blocks of 4 tokens, six concurrent 12-token completions. Each needs 4 blocks
    to start, so three run while three wait: at the gateway, in order; or, without admission control, on the
    decode worker, whose reservations wait for blocks. Before, two got 503 and four hung in a decode pool that
    could schedule nothing."""
    argv = serve_argv(smollm2_gguf, "--num-kv-blocks", "12", "--block-size", "4", "--max-model-len", "40", admission,
                      "--disagg-prefill-threshold", "0")  # the decode worker reserves blocks for remote KV
    with serving(argv, stderr_path=tmp_path / "stderr.txt") as serve:
        url = serve.url

        def complete(i: int) -> httpx.Response:
            body = {"model": smollm2_gguf, "prompt": [100 + i + j for j in range(12)], "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(complete, range(6)))
        assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
        assert all(r.json()["usage"]["completion_tokens"] == 12 for r in responses)
        assert all(value == 0 for _, value in _samples(url, "splitserve:kv_blocks_used"))
