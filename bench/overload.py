"""Goodput as offered load rises past capacity, with and without the gateway's admission control, in one run.

    python bench/overload.py [--loads 0.5,1,2,5,10] [--duration 30] [--slo-ttft 3]
                             [--serve-flags "--max-num-seqs 32"] [--admission-flags "--queue-timeout 1.5"]

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
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_process import Serve, metric  # noqa: E402
from bench.serve_process import aiperf as run_aiperf  # noqa: E402

SLO_FLAGS = ["--endpoint-type", "completions", "--streaming", "--use-server-token-count",
             "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev", "0",
             "--output-tokens-mean", "16", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
             "--random-seed", "7", "--request-timeout-seconds", "120"]


def aiperf(args: argparse.Namespace, url: str, load_flags: list[str], slo_s: float) -> dict:
    """One AIPerf run of the short-completion workload at `load_flags`; its summary JSON."""
    return run_aiperf(url, [*SLO_FLAGS, "--goodput", f"time_to_first_token:{slo_s * 1000:.0f}", *load_flags])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="0.5,1,2,5,10")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    parser.add_argument("--calibration-concurrency", type=int, default=64)
    parser.add_argument("--serve-flags", default="--max-model-len 256")
    parser.add_argument("--admission-flags", default="")
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    base = shlex.split(args.serve_flags)
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
