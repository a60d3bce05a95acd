"""Priority through the whole cluster: interactive requests into a saturated `splitserve serve` (1 prefill + 1
decode worker, the gateway's admission control on), `--scheduling-policy fcfs` against `priority`, one server after
the other in the same run.

    python bench/priority_serving.py [--rounds 1] [--background-concurrency 32] [--probes 8]

Background: AIPerf (kept out of splitserve's dependencies; bench/serve_process.py finds it) keeps
`--background-concurrency` streamed completions in flight (`--background-isl` prompt tokens, `--background-osl`
generated, EOS ignored), more than the decode pool's slots, so the gateway queues them; under `priority` each carries
`"priority": 5` (AIPerf's --extra-inputs). Interactive: once AIPerf has run `--warmup` seconds, `--probes` streamed
completions (a short prompt, `--probe-osl` tokens) are sent on a fixed schedule, one every `--probe-interval`
seconds, each in its own thread (none waits for another), each `"priority": 0`
under `priority` (fcfs takes no other value, so there they queue behind the backlog in arrival order); each one's
TTFT (request sent -> first token) and end-to-end time are measured here.

Printed per policy: the probes' TTFT p50 / max and end-to-end p50; the background's request throughput, TTFT p50
and output tokens/s (AIPerf's); then priority / fcfs ratios.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_process import MODEL, Serve, aiperf, metric  # noqa: E402

PROBE_PROMPT = "Answer in one word: the capital of France is"


def probe(url: str, priority: int | None, max_tokens: int) -> tuple[float, float]:
    """One streamed completion: (TTFT, end-to-end) in seconds."""
    body = {"model": MODEL, "prompt": PROBE_PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if priority is not None:
        body["priority"] = priority
    began = time.monotonic()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                first = time.monotonic()
    end = time.monotonic()
    return (first or end) - began, end - began


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, float]:
    server = Serve(["--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
                    "1024", "--max-queued-requests", str(args.background_concurrency * 2),
                    *shlex.split(args.serve_flags)])
    try:
        extra = ["--extra-inputs", "priority:5"] if policy == "priority" else []
        flags = ["--endpoint-type", "completions", "--streaming", "--use-server-token-count",
                 "--synthetic-input-tokens-mean", str(args.background_isl), "--synthetic-input-tokens-stddev", "0",
                 "--output-tokens-mean", str(args.background_osl), "--output-tokens-stddev", "0",
                 "--extra-inputs", "ignore_eos:true", *extra, "--random-seed", "7",
                 "--request-timeout-seconds", "600", "--concurrency", str(args.background_concurrency),
                 "--request-count", str(args.background_requests)]
        summary: dict = {}
        background = threading.Thread(target=lambda: summary.update(aiperf(server.url, flags)), daemon=True)
        background.start()
        began = time.monotonic()
        times: list[tuple[float, float]] = []
        probes = []
        for i in range(args.probes):  # on a fixed schedule, each in its own thread: none waits for another
            time.sleep(max(0.0, began + args.warmup + i * args.probe_interval - time.monotonic()))
            queued = [line.split()[-1] for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                      if line.startswith("splitserve:admission_queue_requests")]
            print(f"  {policy} probe {i + 1} at {time.monotonic() - began:.1f} s, gateway queue {queued}", flush=True)
            probes.append(threading.Thread(target=lambda: times.append(
                probe(server.url, 0 if policy == "priority" else None, args.probe_osl)), daemon=True))
            probes[-1].start()
        for thread in probes:
            thread.join()
        background.join()
    finally:
        server.stop()
    ttft = [t for t, _ in times]
    return {
        "probe_ttft_p50_s": statistics.median(ttft), "probe_ttft_max_s": max(ttft),
        "probe_e2e_p50_s": statistics.median(e for _, e in times),
        "background_req_per_s": metric(summary, "request_throughput"),
        "background_ttft_p50_s": metric(summary, "time_to_first_token", "p50") / 1000,
        "background_tok_per_s": metric(summary, "output_token_throughput"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1, help="rounds per policy, alternating")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--background-concurrency", type=int, default=32)
    p.add_argument("--background-requests", type=int, default=120)
    p.add_argument("--background-isl", type=int, default=128)
    p.add_argument("--background-osl", type=int, default=32)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of background before the first probe")
    p.add_argument("--serve-flags", default="", help="more `serve` flags, e.g. \"--max-num-batched-tokens 512\"")
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--probe-osl", type=int, default=8)
    p.add_argument("--probe-interval", type=float, default=3.0)
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {"fcfs": [], "priority": []}
    for r in range(args.rounds):
        for policy in ("fcfs", "priority"):
            result = run_policy(policy, args)
            results[policy].append(result)
            print(f"round {r + 1} {policy}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
    print(f"\n{'':26s}{'fcfs':>10s}{'priority':>10s}{'ratio':>9s}")
    for key in results["fcfs"][0]:
        fcfs = statistics.median(r[key] for r in results["fcfs"])
        prio = statistics.median(r[key] for r in results["priority"])
        print(f"{key:26s}{fcfs:10.3f}{prio:10.3f}{(f'{prio / fcfs:.3f}x' if fcfs else '-'):>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
