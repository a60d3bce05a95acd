"""One layout of a plan against a real `splitserve serve` of it: AIPerf at a few Poisson rates, and the plan's
prediction at each rate, metric by metric (`splitserve plan --validate`'s comparison).

    python bench/plan_check.py --profile profile.json --layout 1P+1D --max-num-seqs 16 --rates 0.5,1 \
        --isl 256 --osl 32 --ttft-slo 2 --tpot-slo 0.15 --out DIR [--num-requests 40] [--one-host] \
        [--client-cores C]

Writes DIR/plan.json (`plan --json` of that traffic and SLO, no rate: each layout's highest rate) and
DIR/report.json (schema splitserve-bench/1, deploy/planner/validate.py: the served layout and one run per rate,
as `splitserve bench` writes them: deploy/bench/report.py, with the requests sent and the gateway's TTFT stage
histograms over each run), then prints
`splitserve plan --profile ... --validate DIR`. `--layout` is `NP+MD` (disaggregated, --kv-transport grpc) or
`colocatedxN`, a pool at a tensor-parallel size as the plan names it (`1P(TP2)+2D`, `colocated(TP2)x1`). With `--one-host` (the workers share this machine's cores, as `serve` does on one machine) the
prediction scales compute times accordingly, and counts AIPerf's own CPU against the workers' cores: the cores
its processes kept busy while each run's requests ran (deploy/bench/client_cpu.py: their CPU from /proc, between
the start and end times its summary gives; its start-up before them left out), recorded as the run's
`client_cores` and priced run by run (`plan --validate` without --client-cores does the same), or `--client-cores`
for every run. plan.json (the plan at the runs' mean client cores, or the flag's) is written after the runs.
AIPerf requests `--isl` synthetic prompt tokens (stddev 0) and `--osl` output tokens with ignore_eos, streamed,
each run from its own `--random-seed`, `--seed` + its place in `--rates` (a warm-up of 4 requests first, from
`--seed` + 1000): give each repeated pass its own `--seed`, or it replays the same arrivals. A run that repeated an
earlier one's prompts would hit the prefix cache. AIPerf is not a splitserve dependency (see bench/serve_process.py
for its venv).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_process import Serve, aiperf  # noqa: E402
from deploy.bench import stages  # noqa: E402
from deploy.bench.client_cpu import ClientCpu  # noqa: E402
from deploy.bench.report import run_from_summary  # noqa: E402
from deploy.planner.load_probe import aiperf_epoch_s  # noqa: E402
from deploy.planner.planner import SLO, Layout, PlanOptions, Traffic, plan  # noqa: E402
from deploy.planner.profile import load_profile  # noqa: E402
from deploy.planner.render import plan_json, serve_flags  # noqa: E402
from deploy.planner.validate import compare_run_dir, format_comparisons  # noqa: E402


def parse_layout(text: str, max_num_seqs: int) -> Layout:
    """`NP+MD` or `colocatedxN`, each pool optionally at a tensor-parallel size as the plan's table names it:
    `1P(TP2)+2D`, `colocated(TP2)x1`."""
    size = r"(?:\(TP(\d+)\))?"
    if match := re.fullmatch(rf"(\d+)P{size}\+(\d+)D{size}", text):
        return Layout(num_prefill=int(match[1]), num_decode=int(match[3]), max_num_seqs=max_num_seqs,
                      transport="grpc", prefill_tp=int(match[2] or 1), decode_tp=int(match[4] or 1))
    if match := re.fullmatch(rf"colocated{size}x(\d+)", text):
        return Layout(num_colocated=int(match[2]), max_num_seqs=max_num_seqs, tp=int(match[1] or 1))
    raise SystemExit(f"--layout: NP+MD or colocatedxN (a pool's size as NP(TP2)), got {text!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--rates", default="0.5,1")
    p.add_argument("--isl", type=int, default=256)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tpot-slo", type=float, default=0.15)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--seed", type=int, default=7, help="AIPerf's --random-seed of the first rate (+1 each next)")
    p.add_argument("--one-host", action="store_true")
    p.add_argument("--client-cores", type=float, default=None,
                   help="cores AIPerf keeps busy (default: measured over each run's requests)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.profile)
    layout = parse_layout(args.layout, args.max_num_seqs)
    traffic = Traffic(isl=args.isl, osl=args.osl)
    slo = SLO(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo)
    flags = serve_flags(profile, layout)[2:]  # Serve gives --model itself
    workload = ["--endpoint-type", "completions", "--streaming", "--use-server-token-count",
                "--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
                "--extra-inputs", "ignore_eos:true", "--request-timeout-seconds", "600",
                "--goodput", f"time_to_first_token:{args.ttft_slo * 1000:.0f} "
                             f"inter_token_latency:{args.tpot_slo * 1000:.0f}"]
    runs = []
    server = Serve(flags, model=profile.model.name, stderr_path=str(out / "serve.log"))
    try:
        # Every run its own prompts (AIPerf's seed): a run repeating an earlier one's would hit the prefix cache.
        aiperf(server.url, [*workload, "--request-count", "4", "--concurrency", "1", "--random-seed",
                            str(args.seed + 1000)])  # warm-up: the first requests pay one-time costs
        for i, rate in enumerate(float(r) for r in args.rates.split(",") if r):
            before = stages.scrape(server.url)  # the gateway's TTFT stage histograms, to diff over the run
            with ClientCpu(exclude=server.proc.pid) as sampler:
                summary = aiperf(server.url, [*workload, "--request-rate", str(rate), "--request-count",
                                              str(args.num_requests), "--random-seed", str(args.seed + i)])
            cores = sampler.cores_between(*(aiperf_epoch_s(summary.get(k)) for k in ("start_time", "end_time")))
            (out / f"aiperf-{rate:g}.json").write_text(json.dumps(summary, indent=1))
            try:
                deltas = stages.stage_deltas(before, stages.scrape(server.url))
            except ValueError as exc:  # the run's numbers stand; only its stage breakdown is lost
                print(f"rate {rate}: no TTFT stages: {exc}", file=sys.stderr)
                deltas = None
            runs.append(run_from_summary(summary, mode="rate", point=rate, seed=args.seed + i, command=[],
                                         stages=deltas))
            runs[-1]["num_requests_sent"] = args.num_requests  # validate prices a finite run of these
            runs[-1]["client_cores"] = cores
            print(f"rate {rate}: {json.dumps(runs[-1])}", flush=True)
    finally:
        server.stop()
    layout_json = {"num_colocated": layout.num_colocated, "num_prefill": layout.num_prefill,
                   "num_decode": layout.num_decode, "max_num_seqs": layout.max_num_seqs,
                   "prefill_threshold_tokens": layout.prefill_threshold_tokens, "transport": layout.transport,
                   "tp": layout.tp, "prefill_tp": layout.prefill_tp, "decode_tp": layout.decode_tp}
    measured = [run["client_cores"] for run in runs]
    client_cores = args.client_cores if args.client_cores is not None else sum(measured) / max(1, len(measured))
    print(f"AIPerf kept {', '.join(f'{c:.3f}' for c in measured)} cores busy over each run's requests; the plan "
          f"counts {'those' if args.client_cores is None else f'{client_cores:.2f}'}", flush=True)
    options = PlanOptions(max_workers=max(2, layout.num_ranks), one_host=args.one_host,
                          client_cores=client_cores if args.one_host else 0.0)
    (out / "plan.json").write_text(json.dumps(plan_json(profile, plan(profile, traffic, slo, options)), indent=1))
    (out / "report.json").write_text(json.dumps({"schema": "splitserve-bench/1", "layout": layout_json,
                                                 "serve_flags": flags, "client_cores": client_cores, "runs": runs},
                                                indent=1))
    comparisons, summary = compare_run_dir(profile, out, options, measured_client=args.client_cores is None)
    print(format_comparisons(comparisons, summary))
    print(f"again: splitserve plan --profile {args.profile} --validate {out}"
          + (" --one-host" if args.one_host else "")
          + (f" --client-cores {client_cores:.2f}" if args.one_host and args.client_cores is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
