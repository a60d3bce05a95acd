"""Prefix-aware routing against round-robin and least-loaded, on a real cluster, in one run.

    python bench/prefix_routing.py [--rate 1.5] [--requests 120] [--prefill-workers 2] [--decode-workers 1]

For each `--routing-policy`, a fresh `splitserve serve` (2 prefill + 1 decode worker by default, the embedded
Redis index) and two AIPerf workloads with Poisson arrivals at `--rate` requests/s:

    shared prompts   completions: `--prefixes` long shared prefixes (system prompts or documents,
                     `--prefix-tokens` each) + a short user turn (`--turn-tokens`), 8 tokens out; together the
                     prefixes are more than one worker's KV cache holds (`--serve-flags` sets it), as a
                     deployment's working set is more than one replica's memory
    chats            chat completions: multi-turn conversations (AIPerf replays each conversation's history on
                     every turn), 16 tokens out per turn

Measured per policy and workload, from AIPerf (TTFT) and the gateway's /metrics before and after (workers' own
counters): prefill tokens computed (prompt tokens queried minus prefix-cache hits, over every worker), KV bytes
moved prefill -> decode, the prefix hit rate, TTFT p50/p99. Printed with each policy's ratio to round-robin.
Issue 16's target: prefix-aware computes <= 0.5x the prefill tokens of round-robin, with >= 2x better TTFT p50.
AIPerf setup: see bench/serve_process.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.serve_process import Serve, aiperf, metric  # noqa: E402

POLICIES = ("prefix-aware", "round-robin", "least-loaded")


def worker_counters(url: str) -> dict[str, float]:
    """Sums over the workers: prefix-cache queries and hits (tokens), KV bytes received by decode workers; and
    requests by prefill path."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {"queries": 0.0, "hits": 0.0, "kv_bytes": 0.0, "local": 0.0, "remote": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "splitserve:prefix_cache_queries_total":
                out["queries"] += s.value
            elif s.name == "splitserve:prefix_cache_hits_total":
                out["hits"] += s.value
            elif s.name == "splitserve:kv_transfer_bytes_total" and s.labels["worker"].startswith("decode"):
                out["kv_bytes"] += s.value
            elif s.name == "splitserve:requests_by_prefill_path_total" and s.labels["path"] in ("local", "remote"):
                out[s.labels["path"]] += s.value
    return out


def error_kinds(summary: dict) -> str:
    """AIPerf's failed requests by HTTP status code and message, e.g. `2x 503 queued too long`."""
    kinds = []
    for item in summary.get("error_summary") or []:
        details = item.get("error_details") or {}
        kinds.append(f"{item.get('count')}x {details.get('code') or ''} {(details.get('message') or '')[:60]}")
    return "; ".join(kinds)


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    load = ["--request-rate", str(args.rate), "--arrival-pattern", "poisson", "--random-seed", "11",
            "--streaming", "--use-server-token-count", "--request-timeout-seconds", "300"]
    return {
        "shared prompts": [
            "--endpoint-type", "completions", "--request-count", str(args.requests),
            "--prompt-prefix-pool-size", str(args.prefixes), "--prompt-prefix-length", str(args.prefix_tokens),
            "--synthetic-input-tokens-mean", str(args.turn_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", "8", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", *load],
        "chats": [
            "--endpoint-type", "chat", "--conversation-num", str(max(1, args.requests // 8)),
            "--conversation-turn-mean", "4", "--conversation-turn-stddev", "0",
            "--synthetic-input-tokens-mean", str(args.turn_tokens * 2), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", "16", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", *load],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=120, help="requests of the shared-prompt workload")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=384)
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument("--prefill-workers", type=int, default=2)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--serve-flags", default="--max-model-len 2048 --num-kv-blocks 256",
                        help="every worker's cache: 256 blocks of 16 tokens (4096 tokens): the prefixes' 384 blocks "
                             "fit in two prefill workers' caches, not in one")
    args = parser.parse_args()

    rows = []
    for policy in POLICIES:
        server = Serve(["--prefill-workers", str(args.prefill_workers), "--decode-workers",
                        str(args.decode_workers), "--routing-policy", policy, *args.serve_flags.split()])
        try:
            for name, flags in workloads(args).items():
                before = worker_counters(server.url)
                summary = aiperf(server.url, flags)
                after = worker_counters(server.url)
                delta = {k: after[k] - before[k] for k in after}
                rows.append((name, policy, delta["queries"] - delta["hits"], delta["kv_bytes"],
                             delta["hits"] / delta["queries"] if delta["queries"] else 0.0,
                             metric(summary, "time_to_first_token", "p50"),
                             metric(summary, "time_to_first_token", "p99"),
                             int(delta["local"]), int(delta["remote"]),
                             int(metric(summary, "error_request_count")), error_kinds(summary)))
        finally:
            server.stop()
    print(f"{args.prefill_workers} prefill + {args.decode_workers} decode workers; Poisson {args.rate:g} req/s")
    # "per req": prefill tokens per request a worker served (local + remote), the fair ratio when a policy's
    # queue overflowed and some requests were refused (429) before any worker computed them
    print(f"{'workload':>15} {'policy':>13} {'prefill tok':>11} {'x rr':>5} {'per req':>7} {'x rr':>5} "
          f"{'KV MB':>7} {'hit rate':>8} {'TTFT p50':>9} {'p99 (ms)':>9} {'rr/p50':>6} {'local/remote':>12} "
          f"{'errors':>6}")
    for name, policy, computed, kv_bytes, hit_rate, p50, p99, local, remote, errors, kinds in rows:
        rr = next(r for r in rows if r[0] == name and r[1] == "round-robin")
        per_request = computed / max(local + remote, 1)
        rr_per_request = rr[2] / max(rr[7] + rr[8], 1)
        print(f"{name:>15} {policy:>13} {computed:11.0f} {computed / rr[2] if rr[2] else 0:5.2f} "
              f"{per_request:7.1f} {per_request / rr_per_request if rr_per_request else 0:5.2f} "
              f"{kv_bytes / 1e6:7.1f} {hit_rate:8.2f} {p50:9.0f} {p99:9.0f} {rr[5] / p50 if p50 else 0:6.2f} "
              f"{local:>5}/{remote:<6} {errors:>6} {kinds}")


if __name__ == "__main__":
    main()
