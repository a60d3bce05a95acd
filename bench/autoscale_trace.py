"""Record the pools' autoscaling signals through a burst: quiet, waves of concurrent completions, quiet again.

    python bench/autoscale_trace.py --out tests/router/data/burst_trace.json [--waves 3] [--concurrency 12]
                                    [--serve-flags "--prefill-workers 1 --decode-workers 1"]

Starts a real `splitserve serve` (fixed pools: the trace is what the autoscaler would see, not what it would do),
scrapes `/metrics` every `--tick` seconds and writes, per tick, the `splitserve:pool_*` signals of each pool
(router/pool_signals.py's `PoolSignals` fields, the gateway's admission queue as the decode pool's
`num_gateway_queued`). tests/router/test_autoscale_policy.py replays such traces through the decision function.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.serve_process import MODEL, Serve  # noqa: E402

PROMPT = "Write one sentence about the sea, the wind and the boats that sail there, number {i}."


def scrape(url: str) -> dict[str, dict[str, object]]:
    """The pools' signals as PoolSignals fields (latencies as {p50, p90, p99, num_samples} or None)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))

    def one(name: str, **labels: str) -> float:
        found = [v for lab, v in samples.get(name, []) if labels.items() <= lab.items()]
        return found[0] if found else 0.0

    def latency(name: str, pool: str, metric: str) -> dict[str, float] | None:
        n = int(one("splitserve:pool_latency_window_samples", pool=pool, metric=metric))
        if not n:
            return None
        return {"p50": one(name, pool=pool, quantile="0.5"), "p90": one(name, pool=pool, quantile="0.9"),
                "p99": one(name, pool=pool, quantile="0.99"), "num_samples": n}

    pools = {}
    for pool in ("prefill", "decode"):
        pools[pool] = {
            "num_workers": int(one("splitserve:pool_num_workers", pool=pool)),
            "num_requests_waiting": int(one("splitserve:pool_num_requests_waiting", pool=pool)),
            "num_requests_running": int(one("splitserve:pool_num_requests_running", pool=pool)),
            "num_queued_prompt_tokens": int(one("splitserve:pool_num_queued_prompt_tokens", pool=pool)),
            "kv_cache_usage_mean": one("splitserve:pool_kv_cache_usage_perc", pool=pool, stat="mean"),
            "kv_cache_usage_max": one("splitserve:pool_kv_cache_usage_perc", pool=pool, stat="max"),
            "num_gateway_queued": int(one("splitserve:admission_queue_requests")) if pool == "decode" else 0,
            "ttft_s": latency("splitserve:pool_time_to_first_token_seconds", pool, "ttft") if pool == "prefill"
            else None,
            "tpot_s": latency("splitserve:pool_time_per_output_token_seconds", pool, "tpot") if pool == "decode"
            else None,
        }
    return pools


async def waves(url: str, model: str, num_waves: int, concurrency: int, max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for wave in range(num_waves):
            await asyncio.gather(*(client.post("/v1/completions", json={
                "model": model, "prompt": PROMPT.format(i=wave * concurrency + i), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}) for i in range(concurrency)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--serve-flags", default="--max-model-len 256 --num-kv-blocks 128 --no-prefix-index "
                   "--disagg-prefill-threshold 0 --autoscale-window 5")
    p.add_argument("--tick", type=float, default=0.5, help="seconds between scrapes")
    p.add_argument("--quiet-before", type=float, default=5.0)
    p.add_argument("--quiet-after", type=float, default=20.0)
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()

    serve = Serve(shlex.split(args.serve_flags), model=args.model)
    trace: list[dict[str, object]] = []
    try:
        start = time.monotonic()

        def record_until(deadline: float) -> None:
            while time.monotonic() < deadline:
                trace.append({"t": round(time.monotonic() - start, 2), "pools": scrape(serve.url)})
                time.sleep(args.tick)

        record_until(start + args.quiet_before)
        load = asyncio.new_event_loop()
        worker = threading.Thread(target=lambda: load.run_until_complete(
            waves(serve.url, args.model, args.waves, args.concurrency, args.max_tokens)))
        worker.start()
        while worker.is_alive():
            record_until(time.monotonic() + args.tick)
        record_until(time.monotonic() + args.quiet_after)
    finally:
        serve.stop()
    with open(args.out, "w") as f:
        json.dump({"serve_flags": args.serve_flags, "tick_s": args.tick, "waves": args.waves,
                   "concurrency": args.concurrency, "max_tokens": args.max_tokens, "ticks": trace}, f, indent=0)
        f.write("\n")
    print(f"{len(trace)} ticks -> {args.out}")


if __name__ == "__main__":
    main()
