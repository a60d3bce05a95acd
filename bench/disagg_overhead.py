"""Disaggregated vs colocated serving on one machine, same workload, one run; then KV transfer throughput.

    python bench/disagg_overhead.py [--num-requests 20] [--prompt-tokens 1000] [--max-tokens 32]
    python bench/disagg_overhead.py --device cuda --load-format dummy --transports grpc --skip-throughput
                                                        # the three workers on one GPU

Part 1 starts real worker processes (`python -m prefill_worker`, `python -m decode_worker`) and sends the same
requests, one at a time, to (a) one colocated worker and (b) a decode worker that pulls each prompt's KV from a
prefill worker, for each cross-process transport, interleaved: request i goes to each configuration in turn. TTFT is measured at the client from sending the request to the
first streamed token; TPOT is (last token - first token) / (tokens - 1). Each worker process gets the same torch
thread count: with one request in flight at a time, the two phases never compete for the cores.

Part 2 is `bench/kv_transfer_throughput.py`: each transport against a raw TCP socket copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from protos import serving_pb2, serving_pb2_grpc  # noqa: E402


def launch_worker(module: str, *flags: str) -> subprocess.Popen:
    """Start a worker process; `endpoint_of` waits for it to serve (so that several start at once)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *flags], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)},
    )


def endpoint_of(proc: subprocess.Popen) -> str:
    """The endpoint a launched worker prints once it serves; kills it if it printed anything else first."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ENDPOINT "):
        proc.kill()
        raise RuntimeError(f"{' '.join(map(str, proc.args))} did not start (got {line!r})")
    return line.split()[1]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


STAGES = ("decode_queue_s", "prefill_queue_s", "prefill_s", "kv_transfer_s")  # serving.proto StageTimings


def run_request(stub: serving_pb2_grpc.WorkerStub, ids: list[int], max_tokens: int, prefill_endpoint: str
                ) -> tuple[float, float, list[int], dict[str, float]]:
    """(TTFT, TPOT, tokens, the first message's stage timings) of one greedy request that generates exactly
    `max_tokens` tokens."""
    params = serving_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = serving_pb2.GenerateRequest(
        request_id=f"bench-{time.monotonic_ns()}", prompt_token_ids=ids, params=params,
        prefill_endpoint=prefill_endpoint,
    )
    start = time.perf_counter()
    first = last = None
    tokens: list[int] = []
    stages: dict[str, float] = {}
    for msg in stub.Generate(req, timeout=600):
        if msg.error:
            raise RuntimeError(msg.error)
        now = time.perf_counter()
        if msg.token_ids and first is None:
            first = now
            stages = {stage: getattr(msg.timings, stage) for stage in STAGES}
        tokens.extend(msg.token_ids)
        last = now
    assert first is not None and last is not None and len(tokens) == max_tokens
    return first - start, (last - first) / (len(tokens) - 1), tokens, stages


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(name: str, results: list[tuple[float, float, list[int], dict[str, float]]]) -> dict[str, float]:
    ttft = [r[0] for r in results]
    tpot = [r[1] for r in results]
    row = {
        "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
    }
    # Where the TTFT went (p50 of each stage, as the workers measured it; "rest": gRPC hops, scheduling, streaming)
    stages = {stage: percentile([r[3].get(stage, 0.0) for r in results], 0.5) for stage in STAGES}
    rest = row["ttft_p50"] - sum(stages.values())
    breakdown = "  ".join(f"{stage[:-2]} {value * 1e3:.1f}" for stage, value in stages.items() if value)
    print(f"{name:<22} TTFT p50 {row['ttft_p50'] * 1e3:8.1f} ms  p99 {row['ttft_p99'] * 1e3:8.1f} ms   "
          f"TPOT p50 {row['tpot_p50'] * 1e3:7.1f} ms  p99 {row['tpot_p99'] * 1e3:7.1f} ms   "
          f"[{breakdown}  rest {rest * 1e3:.1f} ms]", flush=True)
    return row


def compare(results: dict[str, list[tuple[float, float, list[int], dict[str, float]]]]) -> dict[str, dict]:
    """Print each configuration's row and each transport's ratios against colocated; return them."""
    rows = {name: summarize(name if name == "colocated" else f"disaggregated ({name})", timings)
            for name, timings in results.items()}
    base = rows["colocated"]
    for transport, r in rows.items():
        if transport == "colocated":
            continue
        same = sum(ours[2] == theirs[2] for ours, theirs in zip(results[transport], results["colocated"]))
        r.update(ttft_p50_ratio=r["ttft_p50"] / base["ttft_p50"], ttft_p99_ratio=r["ttft_p99"] / base["ttft_p99"],
                 tpot_p50_ratio=r["tpot_p50"] / base["tpot_p50"], greedy_equal=same, requests=len(results[transport]))
        print(f"disaggregated ({transport}) / colocated: TTFT p50 {r['ttft_p50_ratio']:.3f}x  "
              f"p99 {r['ttft_p99_ratio']:.3f}x   TPOT p50 {r['tpot_p50_ratio']:.3f}x  "
              f"p99 {r['tpot_p99'] / base['tpot_p99']:.3f}x   greedy tokens equal colocated's: "
              f"{same}/{len(results[transport])} requests")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="torch threads per worker")
    parser.add_argument("--transports", default="grpc,torch", help="cross-process transports to compare")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--device", default="cpu", help="the workers' --device (cuda: all three on one GPU)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights of --model's shape")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the same workload this many times on the same workers, a ratio per round")
    parser.add_argument("--json", default=None, help="write every round's rows here")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="one more flag for every worker (repeat: --worker-arg=--no-async-scheduling)")
    args = parser.parse_args()

    rng = random.Random(0)
    # Distinct random prompts: no prefix-cache hit anywhere, so every request pays its full prefill.
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
               for _ in range(args.warmup + args.num_requests * args.rounds)]
    common = ["--model", args.model, "--num-threads", str(args.num_threads), "--max-model-len", "2048",
              "--kv-cache-memory", "512MiB", "--device", args.device, "--load-format", args.load_format, *args.worker_arg]
    print(f"workload: {args.rounds} round(s) of {args.num_requests} requests (+{args.warmup} warm-up), "
          f"{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens, one at a time; "
          f"{args.num_threads} torch threads per worker")
    with ExitStack() as stack:
        # Every configuration up at once, requests interleaved (request i on each in turn): slow drift of the
        # machine hits all of them alike. Idle workers sleep; one request runs at a time.
        targets: dict[str, tuple[serving_pb2_grpc.WorkerStub, str]] = {}
        launched: dict[str, tuple[subprocess.Popen, subprocess.Popen | None]] = {}
        proc = launch_worker("decode_worker", "--role", "colocated", *common)
        stack.callback(stop, proc)
        launched["colocated"] = (proc, None)
        for transport in [t for t in args.transports.split(",") if t]:
            p_proc = launch_worker("prefill_worker", "--kv-transport", transport, *common)
            stack.callback(stop, p_proc)
            d_proc = launch_worker("decode_worker", "--role", "decode", "--kv-transport", transport, *common)
            stack.callback(stop, d_proc)
            launched[transport] = (d_proc, p_proc)
        for name, (serving, prefill_proc) in launched.items():  # all start at once; wait for each in turn
            prefill = endpoint_of(prefill_proc) if prefill_proc is not None else ""
            targets[name] = (serving_pb2_grpc.WorkerStub(grpc.insecure_channel(endpoint_of(serving))), prefill)
        # results[round][name]: request i of the round goes to each configuration in turn
        results: list[dict[str, list[tuple[float, float, list[int], dict[str, float]]]]] = [
            {name: [] for name in targets} for _ in range(args.rounds)]
        for i, ids in enumerate(prompts):
            for name, (stub, prefill_endpoint) in targets.items():
                timing = run_request(stub, ids, args.max_tokens, prefill_endpoint)
                if i >= args.warmup:
                    results[(i - args.warmup) // args.num_requests][name].append(timing)
    report = []
    for round_no, round_results in enumerate(results, 1):
        if args.rounds > 1:
            print(f"-- round {round_no} of {args.rounds}")
        report.append(compare(round_results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": report}, indent=1))

    if not args.skip_throughput:
        print()
        import kv_transfer_throughput  # bench/, next to this file

        kv_transfer_throughput.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
