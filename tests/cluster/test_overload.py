"""`splitserve serve` at several times its capacity: it slows down and refuses what it cannot queue, it never falls
over.

Per pool shape (1 prefill + 1 decode worker, then 2 + 2), against the real cluster and the real model, each
decode worker running at most 64 requests at once (--max-num-seqs), so the gateway admits 64 per decode worker and
queues as many again:
- 500 concurrent streamed completions (short prompts, 16 tokens each): every response is a 200 whose stream
  finished, or a 429 with Retry-After; nothing else (no 5xx, no connection error); at least 100 are served, and
  some refused; each 429's Retry-After is what router/admission.py promises (whole seconds in [1, 60], the
  expected wait: no more than the longest time a request has been served, scaled by (slots + 1) / slots);
- no worker was restarted (`splitserve:worker_restarts_total` all 0) and every worker's KV blocks are free after;
- then 20 more requests, all served.

One cluster for both shapes (a serve start is most of what a shape costs): it starts 1 + 1 and grows to 2 + 2
through the admin API, as an operator would; the gateway's capacity follows the pool's.

Without admission control (issue 15's original failure: a worker's gRPC server had 64 threads, every stream held
one, so past 64 streams its `Health` waited behind them, the controller restarted the worker and every stream on
it failed): one decode worker that may run 512 at once takes all 500 streams; each one is served, `Health` on
every worker answers within the controller's timeout all through the burst, nothing restarts, every block is free
after.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import ClusterAuth, sync_channel
from tests.cluster.load import Outcome, burst
from tests.deploy.processes import serve_argv, serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLUSTER = ClusterAuth(secret="test-cluster-secret")  # the test calls the workers' Health and GetLoad itself
MAX_NUM_SEQS = 64  # per decode worker; 1 + 1 then serves 2 x 64 of the 500, 2 + 2 2 x 128
OLD_NUM_RPC_THREADS = 64  # the gRPC server threads a worker had before issue 15: all the streams it could hold
HEALTH_TIMEOUT_S = 2.0  # serve's --health-check-timeout (its default): the controller's wait for one Health


def _samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def _rejected(url: str) -> dict[str, float]:
    return {labels["reason"]: value for labels, value in _samples(url, "splitserve:admission_rejections_total")}


def _check_retry_after(refused: list[Outcome], *, slots: int, longest_served_s: float) -> None:
    """router/admission.py's promise: Retry-After is the expected wait, (queued + 1) x mean hold / slots, in whole
    seconds within [1, 60]. A refused request found at most `slots` queued (the queue's default bound) and the mean
    hold is a mean of holds, each within a served request's time, so the wait is at most (slots + 1) / slots times
    the longest any request took."""
    values = [o.retry_after for o in refused]
    assert all(v is not None and re.fullmatch(r"[0-9]+", v) for v in values), collections.Counter(values)
    bound = min(60, max(1, math.ceil((slots + 1) / slots * longest_served_s)))
    assert all(1 <= int(v) <= bound for v in values), (collections.Counter(values), bound)  # type: ignore[arg-type]


def _burst_of_500(url: str, model: str, *, slots: int, longest_served_s: float = 0.0) -> tuple[int, float]:
    """500 at once: served or refused, nothing else; Retry-After as promised; no restart; every block free after;
    then 20 more served. The number served, and the longest a served request took (`longest_served_s`: the longest
    before, on this gateway)."""
    rejected_before = _rejected(url)
    outcomes = burst(url, model, num_requests=500, max_tokens=16)
    counts = collections.Counter((o.status, o.completed) for o in outcomes)
    assert set(counts) == {(200, True), (429, False)}, (counts, {o.error for o in outcomes if o.error})
    assert counts[(200, True)] >= 100, counts
    assert all(o.num_tokens == 16 for o in outcomes if o.status == 200)
    longest_served_s = max([longest_served_s] + [o.elapsed_s for o in outcomes if o.status == 200])
    _check_retry_after([o for o in outcomes if o.status == 429], slots=slots, longest_served_s=longest_served_s)

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
    return counts[(200, True)], max([longest_served_s] + [o.elapsed_s for o in after])


def test_500_concurrent_requests_are_served_or_refused_and_nothing_falls_over(smollm2_gguf, tmp_path):
    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--max-model-len", "256",
                      "--max-num-seqs", str(MAX_NUM_SEQS), "--admin-token", TOKEN,
                      "--disagg-prefill-threshold", "0")  # every request through a prefill worker and a KV handoff
    with serving(argv, stderr_path=tmp_path / "stderr.txt") as serve:
        url = serve.url
        _, longest_s = _burst_of_500(url, smollm2_gguf, slots=MAX_NUM_SEQS)  # 1 prefill + 1 decode

        grown = httpx.post(f"{url}/admin/scale", headers=AUTH, json={"prefill": 2, "decode": 2}, timeout=300)
        assert grown.status_code == 200, grown.text

        def every_worker_polled() -> bool:  # the gateway's capacity comes from these loads
            workers = httpx.get(f"{url}/admin/pools", headers=AUTH, timeout=30).json()["workers"]
            return len(workers) == 4 and all(w["load"] and w["load"]["healthy"] for w in workers)

        deadline = time.monotonic() + 60
        while not every_worker_polled():
            assert time.monotonic() < deadline, httpx.get(f"{url}/admin/pools", headers=AUTH, timeout=30).text
            time.sleep(0.5)
        served, _ = _burst_of_500(url, smollm2_gguf, slots=2 * MAX_NUM_SEQS,
                                  longest_served_s=longest_s)  # 2 prefill + 2 decode
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


@dataclass(frozen=True)
class _Probe:
    worker_id: str
    at_s: float  # time.monotonic() when sent
    latency_s: float
    error: str  # "" when Health answered ok
    incarnation: int


class _HealthProbes:
    """Within its `with` block: `Health` on every worker in `workers` (id -> endpoint) every `interval_s`, each with
    the controller's deadline, from a thread per worker; beside them `GetLoad` of each worker in `loaded` (answered
    between engine steps, so with a long deadline), for the most requests its engine held at once."""

    def __init__(self, workers: dict[str, str], *, loaded: Sequence[str], interval_s: float = 0.25) -> None:
        self._channels = {wid: sync_channel(endpoint, CLUSTER) for wid, endpoint in workers.items()}
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self.probes: list[_Probe] = []
        self.most_held: dict[str, int] = {}
        self.load_errors: list[str] = []
        self._threads = [threading.Thread(target=self._health, args=(wid,), daemon=True) for wid in workers]
        self._threads += [threading.Thread(target=self._load, args=(wid,), daemon=True) for wid in loaded]

    def __enter__(self) -> _HealthProbes:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(60)
        for channel in self._channels.values():
            channel.close()

    def _health(self, worker_id: str) -> None:
        stub = serving_pb2_grpc.WorkerStub(self._channels[worker_id])
        while not self._stopping.is_set():
            sent_s = time.monotonic()
            try:
                answer = stub.Health(serving_pb2.HealthRequest(), timeout=HEALTH_TIMEOUT_S)
                error, incarnation = ("" if answer.ok else "not ok"), answer.incarnation
            except grpc.RpcError as exc:
                error, incarnation = f"{exc.code().name}: {exc.details()}", 0
            self.probes.append(_Probe(worker_id, sent_s, time.monotonic() - sent_s, error, incarnation))
            self._stopping.wait(max(0.0, self._interval_s - (time.monotonic() - sent_s)))

    def _load(self, worker_id: str) -> None:
        stub = serving_pb2_grpc.WorkerStub(self._channels[worker_id])
        while not self._stopping.is_set():
            try:
                load = stub.GetLoad(serving_pb2.LoadRequest(), timeout=60)
            except grpc.RpcError as exc:  # only a measure of the load; Health is what must answer
                self.load_errors.append(f"{exc.code().name}: {exc.details()}")
            else:
                held = load.num_requests_running + load.num_requests_waiting
                self.most_held[worker_id] = max(self.most_held.get(worker_id, 0), held)
            self._stopping.wait(self._interval_s)


def test_one_decode_worker_holds_500_streams_without_admission_control(smollm2_gguf, tmp_path) -> None:
    # Short answers keep it quick; the KV cache holds every request at once (1 block each, 728 blocks per worker).
    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--max-model-len", "256",
                      "--no-admission-control", "--max-num-seqs", "512", "--kv-cache-memory", "512MiB",
                      "--health-check-timeout", str(HEALTH_TIMEOUT_S), "--admin-token", TOKEN,
                      "--cluster-secret", CLUSTER.secret,
                      "--disagg-prefill-threshold", "0")  # every request through a prefill worker and a KV handoff
    with serving(argv, stderr_path=tmp_path / "stderr.txt") as serve:
        url = serve.url
        pools = httpx.get(f"{url}/admin/pools", headers=AUTH, timeout=30).json()["workers"]
        workers = {w["worker_id"]: w["endpoint"] for w in pools}
        assert sorted(w["role"] for w in pools) == ["decode", "prefill"], pools
        (decode_id,) = (w["worker_id"] for w in pools if w["role"] == "decode")
        with _HealthProbes(workers, loaded=[decode_id]) as probes:
            time.sleep(1.0)  # a few probes before the burst: the workers answer when idle
            started_s = time.monotonic()
            outcomes = burst(url, smollm2_gguf, num_requests=500, max_tokens=4)
            ended_s = time.monotonic()
            time.sleep(1.0)

        counts = collections.Counter((o.status, o.completed, o.num_tokens) for o in outcomes)
        assert counts == {(200, True, 4): 500}, (counts, collections.Counter(o.error for o in outcomes if o.error))
        # Its engine really held more requests at once than the old server had threads for streams (its gRPC server
        # held all 500 calls: the gateway opens them at once; the engine counts those whose KV has arrived).
        assert probes.most_held.get(decode_id, 0) > OLD_NUM_RPC_THREADS, (probes.most_held, probes.load_errors[:5])

        failed = [p for p in probes.probes if p.error]
        assert not failed, failed[:10]
        for worker_id in workers:  # sampled all through the burst, every worker on its first incarnation
            during = [p for p in probes.probes if p.worker_id == worker_id and started_s <= p.at_s <= ended_s]
            assert len(during) >= 5, (worker_id, len(during), ended_s - started_s)
            assert len({p.incarnation for p in probes.probes if p.worker_id == worker_id}) == 1
        slowest = max(p.latency_s for p in probes.probes)
        assert slowest < HEALTH_TIMEOUT_S, slowest  # the deadline says so already; said here for the reader

        restarts = _samples(url, "splitserve:worker_restarts_total")
        assert restarts and all(value == 0 for _, value in restarts), restarts
        after = {w["worker_id"]: w["endpoint"] for w in httpx.get(f"{url}/admin/pools", headers=AUTH,
                                                                 timeout=30).json()["workers"]}
        assert after == workers  # the same processes, at the same endpoints
        deadline = time.monotonic() + 30
        while any(value for _, value in _samples(url, "splitserve:kv_blocks_used")):
            assert time.monotonic() < deadline, _samples(url, "splitserve:kv_blocks_used")
            time.sleep(0.5)
