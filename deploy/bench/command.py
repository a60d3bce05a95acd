"""`splitserve bench`: AIPerf against an OpenAI server at one load or a sweep of loads, and a report.

    splitserve bench --url http://127.0.0.1:8000 --workload random --rate 1 --sweep 2,4 --num-requests 100 \
        --isl 256 --osl 64 --ttft-slo 2 --tpot-slo 0.15 --out DIR

The load is --rate R (Poisson requests/s) or --concurrency C (requests kept in flight), exactly one; --sweep adds
more points of the same kind: the points run are R (or C) and the --sweep values, ascending, each once. Each point
is one AIPerf run of --num-requests requests with its own prompts (AIPerf's --random-seed: --seed + the point's
index; a point repeating another's prompts would hit the prefix cache), after --warmup requests from another seed.
Around each run the gateway's TTFT stage histograms are scraped from /metrics (stages.py). Writes, in DIR:

    report.json                 schema splitserve-bench/1 (report.py), readable by `splitserve plan --validate`
    report.html, *.png          the tables and plots (html_report.py, plots.py)
    aiperf/<point>/             each AIPerf run's own artifacts and log

Exit status: 0; 1 when AIPerf fails (its log's tail is printed); 2 for bad input (no load, a bad workload file, an
unreachable URL, AIPerf or matplotlib missing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from deploy.bench.workload import WORKLOADS
from router import package_version


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="drive AIPerf against an OpenAI server; report.json, report.html, plots")
    p.add_argument("--url", required=True, help="the server's base URL (http://host:port; host:port means http)")
    p.add_argument("--workload", default="random", metavar="{" + ",".join(WORKLOADS) + ",FILE.jsonl}",
                   help="the requests' shape (deploy/bench/workload.py)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="requests/s, Poisson arrivals")
    load.add_argument("--concurrency", type=int, default=None, help="requests kept in flight")
    p.add_argument("--sweep", default=None,
                   help="more load points of --rate's or --concurrency's kind, comma-separated (e.g. 2,4)")
    p.add_argument("--num-requests", type=int, default=100, help="requests per load point")
    p.add_argument("--isl", type=int, default=256, help="prompt tokens per request (per turn for chat)")
    p.add_argument("--osl", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--prefix-length", type=int, default=512, help="shared-prefix: tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--turns", type=int, default=3, help="chat: turns per conversation")
    p.add_argument("--endpoint", default=None, choices=("completions", "chat"),
                   help="the OpenAI endpoint (default: chat for chat and files, else completions)")
    p.add_argument("--model", default=None, help="the model to ask for (default: the server's first, /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="AIPerf's --tokenizer (default: the served model's, saved locally; or builtin, an HF id)")
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds: the TTFT a request must meet for goodput")
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds: the TPOT a request must meet for goodput")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (concurrency 1) before the first point")
    p.add_argument("--seed", type=int, default=0, help="AIPerf's --random-seed of the first point")
    p.add_argument("--aiperf", default=None, help="the aiperf executable (default: $AIPERF, .venv-aiperf, PATH)")
    p.add_argument("--out", required=True, help="the report's directory")
    p.set_defaults(func=run_bench_command)


def load_points(rate: float | None, concurrency: int | None, sweep: str | None) -> tuple[str, list[float]]:
    """("rate" | "concurrency", the points ascending); ValueError without a load or with a bad value."""
    if rate is None and concurrency is None:
        raise ValueError("bench needs a load: --rate R (requests/s) or --concurrency C (requests in flight)")
    mode = "rate" if rate is not None else "concurrency"
    first = rate if rate is not None else concurrency
    try:
        extra = [float(v) for v in sweep.split(",") if v.strip()] if sweep else []
    except ValueError:
        raise ValueError(f"--sweep: comma-separated numbers, got {sweep!r}") from None
    points = sorted({float(first), *extra})  # type: ignore[arg-type]
    if mode == "rate" and points[0] <= 0:
        raise ValueError(f"--rate and --sweep: requests/s must be positive, got {points[0]:g}")
    if mode == "concurrency" and any(p < 1 or p != int(p) for p in points):
        raise ValueError(f"--concurrency and --sweep: whole numbers >= 1, got {', '.join(f'{p:g}' for p in points)}")
    return mode, points


def served_model(url: str, *, timeout_s: float = 10.0) -> str:
    """The first model the server lists (/v1/models); ValueError naming the URL when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout_s) as response:
            models = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"--url {url}: no OpenAI server answers GET /v1/models ({reason}); --url is the "
                         "server's base URL, e.g. http://127.0.0.1:8000") from None
    data = models.get("data") if isinstance(models, dict) else None
    if not data:
        raise ValueError(f"--url {url}: /v1/models lists no model; pass --model")
    return str(data[0]["id"])


def run_bench_command(args: argparse.Namespace) -> int:
    from deploy.bench import html_report, plots, report, stages
    from deploy.bench.aiperf_driver import AIPerfError, aiperf_command, find_aiperf, run_aiperf
    from deploy.bench.client_cpu import ClientCpu
    from deploy.planner.load_probe import aiperf_epoch_s
    from deploy.bench.tokenizer import aiperf_tokenizer
    from deploy.bench.workload import aiperf_flags, make_workload

    mode, points = load_points(args.rate, args.concurrency, args.sweep)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    for flag, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    workload = make_workload(args.workload, isl=args.isl, osl=args.osl, prefix_length=args.prefix_length,
                             num_prefixes=args.num_prefixes, turns=args.turns, endpoint=args.endpoint)
    plots.require_matplotlib()
    aiperf = find_aiperf(args.aiperf)
    url = args.url.rstrip("/") if "://" in args.url else f"http://{args.url.rstrip('/')}"  # as AIPerf reads it
    model = args.model or served_model(url)
    tokenizer, env = aiperf_tokenizer(model, args.tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slo = {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo}
    goodput = " ".join(f"{name}:{value * 1000:g}" for name, value in (("time_to_first_token", args.ttft_slo),
                                                                        ("inter_token_latency", args.tpot_slo))
                       if value is not None)

    def command(flags: list[str], name: str) -> tuple[list[str], Path]:
        artifacts = out / "aiperf" / name
        return aiperf_command(aiperf, url=url, model=model, tokenizer=tokenizer, artifact_dir=artifacts,
                              flags=flags), artifacts

    result = report.new_report(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               url=url, model=model, workload=workload.as_json(), mode=mode, points=points, slo=slo,
                               splitserve_version=package_version())
    try:
        if args.warmup > 0:
            cmd, artifacts = command([*aiperf_flags(workload, num_requests=args.warmup), "--request-count",
                                      str(args.warmup), "--concurrency", "1", "--random-seed",
                                      str(args.seed + 1000)], "warmup")
            run_aiperf(cmd, env=env, artifact_dir=artifacts)
        for i, point in enumerate(points):
            load = ["--request-rate", f"{point:g}"] if mode == "rate" else ["--concurrency", str(int(point))]
            flags = [*aiperf_flags(workload, num_requests=args.num_requests), *load,
                     "--request-count", str(args.num_requests), "--random-seed", str(args.seed + i)]
            if goodput:
                flags += ["--goodput", goodput]
            cmd, artifacts = command(flags, f"{mode}-{point:g}")
            before = stages.scrape(url)
            with ClientCpu() as client:  # AIPerf's own CPU over its requests (what plan --one-host counts)
                summary = run_aiperf(cmd, env=env, artifact_dir=artifacts)
            try:
                deltas = stages.stage_deltas(before, stages.scrape(url))
            except ValueError as exc:  # the run's numbers stand; only its stage breakdown is lost
                print(f"splitserve bench: {mode} {point:g}: no TTFT stages: {exc}", file=sys.stderr)
                deltas = {}
            try:
                run = report.run_from_summary(summary, mode=mode, point=point, seed=args.seed + i, command=cmd,
                                              stages=deltas)
            except ValueError as exc:
                raise AIPerfError(f"{mode} {point:g}: {exc} (its log: {artifacts / 'aiperf.log'})") from None
            run["client_cores"] = client.cores_between(*(aiperf_epoch_s(summary.get(k))
                                                         for k in ("start_time", "end_time")))
            report.add_run(result, run, summary)
            _write_json(out / "report.json", result)  # a sweep cut short keeps the points it ran
            print(f"splitserve bench: {mode} {point:g}: {_line(run)}", file=sys.stderr, flush=True)
    except AIPerfError as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 1
    images = plots.draw(result, out)
    result["plots"] = images
    _write_json(out / "report.json", result)
    (out / "report.html").write_text(html_report.render(result, images), encoding="utf-8")
    print(f"splitserve: bench report in {out}/report.json, {out}/report.html ({len(images)} plots)")
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _line(run: dict[str, Any]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    return (f"{run['num_requests']} requests, {s(run['throughput_rps'])} req/s, TTFT p50/p90 "
            f"{s(run['ttft_s']['p50'])}/{s(run['ttft_s']['p90'])} s, TPOT p50/p90 {s(run['tpot_s']['p50'])}/"
            f"{s(run['tpot_s']['p90'])} s, goodput {s(run['goodput_rps'])} req/s")
