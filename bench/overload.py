"""Goodput as offered load rises past capacity, with and without the gateway's admission control, in one run; and
what a refusal costs the gateway.

    python bench/overload.py [--loads 0.5,1,2,5,10] [--duration 30] [--slo-ttft 3]
                             [--serve-flags "--max-num-seqs 32"] [--admission-flags "--queue-timeout 1.5"]
                             [--refusals 2000]                  (0: skip the refusal cost; --loads "": skip goodput)

AIPerf (NVIDIA's load generator, on PyPI; kept out of splitserve's dependencies) drives a real `splitserve serve`
(1 prefill + 1 decode worker) with Poisson arrivals of short completions (16 prompt tokens, 16 generated,
streamed). Offline it needs a local tokenizer: `../shared/tools/bench-tokenizer.sh` saves ours, and this script
runs it when the saved copy is missing. Install AIPerf in a venv of its own:

    python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf

1. Capacity: the request throughput at saturation, measured once, on the admission-controlled server (a closed
   loop of `--calibration-concurrency` streams).
2. For each offered load (a multiple of that capacity), each configuration gets the same Poisson schedule for
   `--duration` seconds: `serve <serve-flags> <admission-flags>` and `serve <serve-flags>
   --no-admission-control` (every request straight to the workers, as vLLM does).
3. Goodput is AIPerf's: requests that completed with TTFT <= `--slo-ttft` seconds, per second of the run. Refused
   requests (429) and timed-out ones count as not good. Printed: goodput per load and configuration, its ratio to
   the configuration's own peak, and TTFT p50/p99 of the completed requests.

Issue 15's target: with admission control, goodput at 10x capacity stays within 80% of its peak.

0. Refusal cost, first, on a server of its own (`serve <serve-flags> --max-num-seqs 1 --max-queued-requests 1`,
   every engine step sleeping 5 s): one request runs and one waits, so the gateway's queue is full and stays so;
   `--refusals` requests of the workload's shape (a 16-token prompt, streamed) are then sent over 8 keep-alive
   connections, each answered 429. Printed: the gateway process' CPU time (user + system, /proc/<pid>/stat) per
   429, less what it spends idle with the same two requests held (measured before and after, per second).
   Issue 31's target: <= 0.25 ms per refused request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_process import MODEL, Serve, metric  # noqa: E402
from bench.serve_process import aiperf as run_aiperf  # noqa: E402

FAULT_STEP_SLEEP_ENV = "SPLITSERVE_FAULT_STEP_SLEEP_S"  # worker/runtime.py's (which imports torch)
# The goodput workload's request: 16 prompt tokens (SmolLM2's tokenizer), 16 out, streamed.
REFUSED_BODY = {"model": MODEL, "max_tokens": 16, "stream": True, "ignore_eos": True,
                "prompt": "The quick brown fox jumps over the lazy dog while the farmer sleeps under the"}

SLO_FLAGS = ["--endpoint-type", "completions", "--streaming", "--use-server-token-count",
             "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev", "0",
             "--output-tokens-mean", "16", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
             "--random-seed", "7", "--request-timeout-seconds", "120"]


def aiperf(args: argparse.Namespace, url: str, load_flags: list[str], slo_s: float) -> dict:
    """One AIPerf run of the short-completion workload at `load_flags`; its summary JSON."""
    return run_aiperf(url, [*SLO_FLAGS, "--goodput", f"time_to_first_token:{slo_s * 1000:.0f}", *load_flags])


def cpu_s(pid: int) -> float:
    """A process' CPU time so far, user + system, all its threads (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_per_s(pid: int, seconds: float) -> float:
    start_cpu, start = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(pid) - start_cpu) / (time.monotonic() - start)


async def hold(client: httpx.AsyncClient, num_requests: int) -> list[asyncio.Task]:
    """`num_requests` long streamed completions, left open: they hold the pool's slot and the queue's place."""

    async def one() -> None:
        body = {**REFUSED_BODY, "max_tokens": 200}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                pass

    tasks = [asyncio.create_task(one()) for _ in range(num_requests)]
    for _ in range(600):  # until the gateway shows one request in flight and one queued
        text = (await client.get("/metrics")).text
        if ("splitserve:admission_in_flight_requests 1.0" in text
                and "splitserve:admission_queue_requests 1.0" in text):
            return tasks
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the gateway never held 1 running and 1 queued request:\n{text[-2000:]}")


async def refuse(url: str, num_requests: int, num_connections: int = 8) -> dict[int, int]:
    """Send `num_requests` over `num_connections` keep-alive connections; how many got each status."""
    statuses: dict[int, int] = {}
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=num_connections)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        remaining = iter(range(num_requests))

        async def sender() -> None:
            for _ in remaining:
                status = (await client.post("/v1/completions", json=REFUSED_BODY)).status_code
                statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(sender() for _ in range(num_connections)))
    return statuses


def refusal_cost(base_flags: list[str], num_requests: int) -> None:
    """Step 0 of the module docstring: the gateway's CPU per 429, printed."""
    os.environ[FAULT_STEP_SLEEP_ENV] = "5"  # inherited by serve and its workers: the held requests barely move
    try:
        server = Serve([*base_flags, "--max-num-seqs", "1", "--max-queued-requests", "1"])
    finally:
        del os.environ[FAULT_STEP_SLEEP_ENV]
    pid = server.proc.pid  # the gateway runs in serve's own process (the workers and Ray's in others)

    async def run() -> tuple[float, float, float, float, dict[int, int]]:
        holder = httpx.AsyncClient(base_url=server.url, timeout=None)
        held = await hold(holder, 2)
        idle_before = await asyncio.to_thread(idle_cpu_per_s, pid, 5.0)
        start_cpu, start = cpu_s(pid), time.monotonic()
        statuses = await refuse(server.url, num_requests)
        busy_cpu, wall = cpu_s(pid) - start_cpu, time.monotonic() - start
        idle_after = await asyncio.to_thread(idle_cpu_per_s, pid, 5.0)
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await holder.aclose()
        return busy_cpu, wall, idle_before, idle_after, statuses

    try:
        busy_cpu, wall, idle_before, idle_after, statuses = asyncio.run(run())
    finally:
        server.stop()
    idle = (idle_before + idle_after) / 2
    per_429_ms = (busy_cpu - idle * wall) / num_requests * 1000
    print(f"refusal cost: {num_requests} requests in {wall:.2f} s ({num_requests / wall:.0f}/s), statuses "
          f"{dict(sorted(statuses.items()))}; gateway CPU {busy_cpu:.2f} s, idle {idle * 1000:.1f} ms/s "
          f"(before {idle_before * 1000:.1f}, after {idle_after * 1000:.1f}): {per_429_ms:.3f} ms of CPU per 429 "
          f"(target <= 0.25)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="0.5,1,2,5,10")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    parser.add_argument("--calibration-concurrency", type=int, default=64)
    parser.add_argument("--serve-flags", default="--max-model-len 256")
    parser.add_argument("--admission-flags", default="")
    parser.add_argument("--refusals", type=int, default=2000, help="requests refused to measure a 429's CPU (0: skip)")
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",") if x]
    base = shlex.split(args.serve_flags)
    if args.refusals:
        refusal_cost(base, args.refusals)
    if not loads:
        return
    configs = {"admission": base + shlex.split(args.admission_flags), "no-admission": base + ["--no-admission-control"]}

    servers = {name: Serve(flags) for name, flags in configs.items()}
    try:
        calibration = aiperf(args, servers["admission"].url,
                             ["--concurrency", str(args.calibration_concurrency),
                              "--request-count", str(args.calibration_concurrency * 4)], args.slo_ttft)
        capacity = metric(calibration, "request_throughput")
        print(f"capacity: {capacity:.2f} req/s (closed loop of {args.calibration_concurrency}); TTFT SLO "
              f"{args.slo_ttft:g} s; {args.duration:g} s of Poisson arrivals per run")
        for name, flags in configs.items():
            print(f"  {name}: serve {' '.join(flags)}")
        rows = []
        for load in loads:
            rate = load * capacity
            for name, server in servers.items():
                summary = aiperf(args, server.url,
                                 ["--request-rate", f"{rate:.3f}", "--arrival-pattern", "poisson",
                                  "--request-count", str(max(1, round(rate * args.duration)))], args.slo_ttft)
                rows.append((load, name, metric(summary, "goodput"), metric(summary, "request_throughput"),
                             metric(summary, "time_to_first_token", "p50") / 1000,
                             metric(summary, "time_to_first_token", "p99") / 1000,
                             int(metric(summary, "good_request_count")), round(rate * args.duration)))
    finally:
        for server in servers.values():
            server.stop()
    peaks = {name: max(r[2] for r in rows if r[1] == name) for name in configs}
    print(f"{'load':>5} {'config':>13} {'goodput/s':>10} {'of peak':>8} {'done/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'good/sent':>10}")
    for load, name, goodput, throughput, p50, p99, good, sent in rows:
        share = goodput / peaks[name] if peaks[name] else 0.0
        print(f"{load:5g} {name:>13} {goodput:10.2f} {share:8.2f} {throughput:7.2f} {p50:9.2f} {p99:9.2f} "
              f"{good:>5}/{sent:<4}")


if __name__ == "__main__":
    main()
