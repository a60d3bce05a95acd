"""Scaling a running cluster under load: how long a scale-up takes to serve, how long a drain takes, and what
clients see meanwhile, in one rolling 1+1 → 2+2 → 1+1 run.

    python bench/scaling.py [--clients 4] [--max-tokens 32] [--phase-s 20] [--drain-timeout 30]
                            [--serve-flags "--max-model-len 512 --disagg-prefill-threshold 0"]

A real `splitserve serve` (1 prefill + 1 decode worker, the admin API on) under a closed loop of `--clients`
streaming completions (distinct prompts, greedy, `--max-tokens` each), through five phases:

    phase "1+1" ── "scaling up": POST /admin/scale {"prefill": 2, "decode": 2} ──▶ "2+2"
                ── "scaling down": POST /admin/scale {"prefill": 1, "decode": 1} ──▶ "1+1 again"

Printed: the scale-up call's duration, and per new worker the time from the call to its first request (its own
GetLoad shows a request or a KV transfer, polled every 20 ms); the scale-down call's duration and per removed
worker its drain (listed draining → gone, from GET /admin/pools every 50 ms); per phase the requests, errors,
TTFT and TPOT p50 / p90 (TPOT: (end − first token) / (tokens − 1)); and the migrations the gateway counted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_process import MODEL, Serve  # noqa: E402
from protos import serving_pb2, serving_pb2_grpc  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Sample:
    started_s: float
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float = 0.0


class Load:
    """A closed loop of `clients` streaming completions on a thread of its own, until `stop()`."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=300,
                                     limits=httpx.Limits(max_connections=self.clients + 2)) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = f"Client {index}, question {n}: describe the water cycle and name three rivers of Europe."
            body = {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            started = time.perf_counter()
            first, tokens, ok = 0.0, 0, False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            break
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        if chunk.get("choices") and chunk["choices"][0]["text"] and not first:
                            first = time.perf_counter()
                        if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                            ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            end = time.perf_counter()
            if ok and first and tokens > 1:
                self.samples.append(Sample(started_s=started, ok=True, ttft_s=first - started,
                                           tpot_s=(end - first) / (tokens - 1)))
            else:
                self.samples.append(Sample(started_s=started, ok=False))


def pools(url: str, token: str) -> list[dict]:
    return httpx.get(f"{url}/admin/pools", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()["workers"]


def scale(url: str, token: str, **sizes: int) -> None:
    response = httpx.post(f"{url}/admin/scale", headers={"Authorization": f"Bearer {token}"}, json=sizes, timeout=900)
    if response.status_code != 200:
        raise RuntimeError(f"POST /admin/scale {sizes}: {response.status_code} {response.text[:500]}")


def served_something(endpoint: str) -> bool:
    with grpc.insecure_channel(endpoint) as channel:
        load = serving_pb2_grpc.WorkerStub(channel).GetLoad(serving_pb2.LoadRequest(), timeout=5)
    return bool(load.num_requests_running or load.num_requests_waiting or load.num_kv_transfers
                or load.prefix_cache_queries)


def scale_up(url: str, token: str, before: set[str]) -> tuple[float, dict[str, float]]:
    """The scale-up call's duration; per new worker, call → its first request."""
    started = time.perf_counter()
    scale(url, token, prefill=2, decode=2)
    call_s = time.perf_counter() - started
    new = {w["worker_id"]: w["endpoint"] for w in pools(url, token) if w["worker_id"] not in before}
    first: dict[str, float] = {}
    deadline = time.perf_counter() + 120
    while len(first) < len(new) and time.perf_counter() < deadline:
        for worker_id, endpoint in new.items():
            if worker_id not in first and served_something(endpoint):
                first[worker_id] = time.perf_counter() - started
        time.sleep(0.02)
    return call_s, first


def scale_down(url: str, token: str) -> tuple[float, dict[str, float]]:
    """The scale-down call's duration; per removed worker, first listed draining → gone."""
    draining_since: dict[str, float] = {}
    gone_after: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() or set(draining_since) - set(gone_after):
            now = time.perf_counter()
            listed = {w["worker_id"]: w["state"] for w in pools(url, token)}
            for worker_id, state in listed.items():
                if state == "draining":
                    draining_since.setdefault(worker_id, now)
            for worker_id, since in draining_since.items():
                if worker_id not in listed:
                    gone_after.setdefault(worker_id, now - since)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.perf_counter()
    scale(url, token, prefill=1, decode=1)
    call_s = time.perf_counter() - started
    done.set()
    watcher.join(30)
    return call_s, gone_after


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [0])[0]


def migrations(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve:request_migrations_total"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds of load at 1+1, 2+2 and 1+1 again")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--serve-log", default=None, help="write serve's stderr here")
    # every prompt through a prefill worker (the default threshold would prefill these short prompts on the decode
    # worker, leaving the prefill pool idle)
    parser.add_argument("--serve-flags", default="--max-model-len 512 --disagg-prefill-threshold 0")
    args = parser.parse_args()
    token = secrets.token_hex(16)
    server = Serve(["--prefill-workers", "1", "--decode-workers", "1", "--admin-token", token,
                    "--drain-timeout", str(args.drain_timeout), *shlex.split(args.serve_flags)],
                   stderr_path=args.serve_log)
    try:
        load = Load(server.url, args.clients, args.max_tokens).start()
        marks = [("1+1", time.perf_counter())]
        time.sleep(args.phase_s)
        marks.append(("scaling up", time.perf_counter()))
        up_s, first = scale_up(server.url, token, {w["worker_id"] for w in pools(server.url, token)})
        marks.append(("2+2", time.perf_counter()))
        time.sleep(args.phase_s)
        marks.append(("scaling down", time.perf_counter()))
        down_s, drained = scale_down(server.url, token)
        marks.append(("1+1 again", time.perf_counter()))
        time.sleep(args.phase_s)
        load.stop()
        marks.append(("end", time.perf_counter()))
        print(f"scale-up call 1+1 -> 2+2: {up_s:.1f} s; call -> first request: "
              + ", ".join(f"{w} {s:.1f} s" for w, s in sorted(first.items())))
        print(f"scale-down call 2+2 -> 1+1: {down_s:.1f} s; drain (listed draining -> gone): "
              + ", ".join(f"{w} {s:.2f} s" for w, s in sorted(drained.items())))
        print(f"migrations: {migrations(server.url):.0f}")
        print(f"{'phase':<14}{'requests':>9}{'errors':>8}"
              + "".join(f"{name:>10}" for name in ("TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90")))
        for (name, start), (_, end) in itertools.pairwise(marks):
            phase = [s for s in load.samples if start <= s.started_s < end]
            ok = [s for s in phase if s.ok]
            ttft, tpot = [s.ttft_s * 1000 for s in ok], [s.tpot_s * 1000 for s in ok]
            print(f"{name:<14}{len(phase):>9}{len(phase) - len(ok):>8}{percentile(ttft, 50):>8.0f}ms"
                  f"{percentile(ttft, 90):>8.0f}ms{percentile(tpot, 50):>8.0f}ms{percentile(tpot, 90):>8.0f}ms")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
