"""A KV pool below the device cache: TTFT of a prefix the device cache no longer holds, with the disk tier
(`--kv-offload-dir`) against without. Engine level (one in-process SmolLM2 engine per configuration, on cpu),
every configuration in one run, conversations alternating between them.

    python bench/kv_pool.py [--conversations 4] [--history-tokens 2000] [--max-tokens 16] [--threads N]
    python bench/kv_pool.py --serve [...]      the returning chats through a real `splitserve serve`

    returning chats   a conversation's 2,000-token history is prefilled (turn 1, `--max-tokens` out); other
                      traffic (two other conversations' histories) then evicts every device block of it; the
                      conversation returns with a 32-token user turn. Measured: TTFT of the returning turn
                      (request added → first token out), with the disk tier (the history's blocks loaded from
                      disk) and without (recomputed). Issue 35's target: <= 0.25x.
    restart           the engine is closed (its device prefix cache written down to the tier) and a new one
                      started on the same directory; the same returning turn on it, against a cold engine.

The tier's files are written back and dropped from the OS page cache (fsync + POSIX_FADV_DONTNEED, on those files
only) before each returning turn, so a load reads the disk, not memory; `--warm-page-cache` keeps them cached.
The history's blocks are checked to be gone from the device cache before each returning turn, and the returning
turn's greedy tokens to be equal with and without the tier.

    python bench/kv_pool.py --busy-holder [--families 8] [--prefix-tokens 1500] [--rate 0.3] [--requests 40]

    busy holder       a real `splitserve serve` of 2 prefill + 1 decode workers (`--busy-policy`, default
                      least-loaded: the router spreads a family over both prefill workers, as any load-based policy
                      does when its holder is busy), AIPerf sending `--requests` prompts at `--rate` Poisson, each
                      one of `--families` prefixes of `--prefix-tokens` tokens and a 32-token question, 8 tokens
                      out; once with `--no-kv-peer-fetch`, once with peer fetch (the default). Each worker's KV
                      cache holds `--busy-kv-blocks` blocks (a few families), so families are evicted and come back.
                      Measured: TTFT p50 (AIPerf) and the prompt tokens the prefill workers computed (their
                      prefix-cache queries less their hits on every tier, from /metrics). Issue 35's targets:
                      <= 0.3x the tokens, >= 2x better TTFT p50.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402

BLOCK_SIZE = 16
TURN_TOKENS = 32


def tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(100, 40_000), k=n)


def run_to_end(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy `max_tokens` tokens; (tokens, seconds from adding the request to its first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft = None
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == request_id:
                if ttft is None and o.token_ids:
                    ttft = time.perf_counter() - started
                out = o
    assert out is not None and out.finished and ttft is not None
    return list(out.token_ids), ttft


def drop_page_cache(directory: Path) -> None:
    """Write the tier's files back and drop them from the page cache (this directory's files only)."""
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_engine(checkpoint: Checkpoint, tier_dir: Path | None, max_model_len: int) -> LLMEngine:
    tier = {} if tier_dir is None else dict(kv_offload_dir=str(tier_dir), kv_offload_size_bytes=8 << 30)
    # A device cache just above one conversation: its returning turn fits, two other histories evict it.
    num_kv_blocks = -(-max_model_len // BLOCK_SIZE) + 8
    engine = LLMEngine(EngineConfig(dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                                    max_model_len=max_model_len, **tier), checkpoint)
    run_to_end(engine, "warm-up", list(range(100, 164)), 2)  # the first steps of a process are slow
    return engine


def evicted(engine: LLMEngine, history: list[int]) -> bool:
    hashes = engine.make_request("probe", history, SamplingParams()).block_hashes
    return not any(engine.block_pool.get_cached_block(h) for h in hashes)


def returning_chats(args: argparse.Namespace, checkpoint: Checkpoint, root: Path) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    max_model_len = args.history_tokens + args.max_tokens + TURN_TOKENS + 64
    engines = {"no tier": make_engine(checkpoint, None, max_model_len),
               "disk tier": make_engine(checkpoint, root / "returning", max_model_len)}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    other_s: dict[str, list[float]] = {name: [] for name in engines}
    for c in range(args.conversations):
        history = tokens(rng, args.history_tokens)
        others = [tokens(rng, args.history_tokens) for _ in range(2)]
        turn = tokens(rng, TURN_TOKENS)
        answers = {}
        for name in (list(engines) if c % 2 == 0 else list(reversed(engines))):
            engine = engines[name]
            first, _ = run_to_end(engine, f"c{c}-1", history, args.max_tokens)
            started = time.perf_counter()
            for i, other in enumerate(others):
                run_to_end(engine, f"c{c}-other{i}", other, args.max_tokens)
            other_s[name].append(time.perf_counter() - started)
            assert evicted(engine, history), "the other traffic left the history in the device cache"
            if engine.kv_tier is not None:
                assert engine.kv_tier.tier.flush(60)
                if not args.warm_page_cache:
                    drop_page_cache(root / "returning")
            loaded_before = engine.stats().prefix_cache_hits_by_tier.get("disk", 0)
            answers[name], seconds = run_to_end(engine, f"c{c}-2", history + first + turn, args.max_tokens)
            ttft[name].append(seconds)
            if engine.kv_tier is not None:
                num_loaded = engine.stats().prefix_cache_hits_by_tier["disk"] - loaded_before
        assert answers["no tier"] == answers["disk tier"], "the returning turn's tokens differ with the tier"
        print(f"conversation {c}: returning-turn TTFT " + ", ".join(f"{n} {ttft[n][-1]:.3f}s" for n in engines)
              + f" ({num_loaded} of its {len(history + first + turn)} tokens loaded from disk)", flush=True)
    stats = engines["disk tier"].stats()
    print(f"disk tier: {stats.prefix_cache_hits_by_tier}, {stats.kv_offload}")
    for name in engines:
        print(f"other traffic (2 histories of {args.history_tokens} tokens), {name}: "
              f"median {statistics.median(other_s[name]):.3f}s")
        engines[name].close()
    return ttft


def restart(args: argparse.Namespace, checkpoint: Checkpoint, root: Path) -> dict[str, list[float]]:
    rng = random.Random(args.seed + 1)
    max_model_len = args.history_tokens + args.max_tokens + TURN_TOKENS + 64
    ttft: dict[str, list[float]] = {"cold engine": [], "restarted on its tier": []}
    for c in range(args.conversations):
        history, turn = tokens(rng, args.history_tokens), tokens(rng, TURN_TOKENS)
        directory = root / f"restart-{c}"
        engine = make_engine(checkpoint, directory, max_model_len)
        first, _ = run_to_end(engine, "turn-1", history, args.max_tokens)
        engine.close()  # writes its device prefix cache down
        if not args.warm_page_cache:
            drop_page_cache(directory)
        answers = {}
        for name in (list(ttft) if c % 2 == 0 else list(reversed(ttft))):
            engine = make_engine(checkpoint, directory if name != "cold engine" else None, max_model_len)
            answers[name], seconds = run_to_end(engine, "turn-2", history + first + turn, args.max_tokens)
            ttft[name].append(seconds)
            engine.close()
            if not args.warm_page_cache:
                drop_page_cache(directory)
        assert answers["cold engine"] == answers["restarted on its tier"]
        print(f"restart {c}: TTFT " + ", ".join(f"{n} {ttft[n][-1]:.3f}s" for n in ttft), flush=True)
    return ttft


def serve_returning_chats(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    """Returning chats through a real `splitserve serve` (one colocated worker), one per configuration in turn:
    TTFT of the streamed returning turn as the client sees it, and the worker's hits by tier from /metrics."""
    import httpx

    from bench.serve_process import MODEL, Serve

    max_model_len = args.history_tokens + args.max_tokens + TURN_TOKENS + 64
    num_kv_blocks = -(-max_model_len // BLOCK_SIZE) + 8
    ttft: dict[str, list[float]] = {"no tier": [], "disk tier": []}
    answers: dict[str, list[str]] = {name: [] for name in ttft}
    for name in ttft:
        tier = [] if name == "no tier" else ["--kv-offload-dir", str(root / "serve"), "--kv-offload-size", "8GiB"]
        server = Serve(["--colocated", "--num-kv-blocks", str(num_kv_blocks), "--max-model-len", str(max_model_len),
                        "--block-size", str(BLOCK_SIZE), "--dtype", "float32", *tier])
        try:
            client = httpx.Client(base_url=server.url, timeout=600)
            rng = random.Random(args.seed + 2)

            def complete(prompt: list[int]) -> None:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                        "ignore_eos": True}
                client.post("/v1/completions", json=body).raise_for_status()

            for c in range(args.conversations):
                history = tokens(rng, args.history_tokens)
                others = [tokens(rng, args.history_tokens) for _ in range(2)]
                turn = tokens(rng, TURN_TOKENS)
                complete(history)
                for other in others:
                    complete(other)
                time.sleep(2)  # the worker's tier writer catches up (both configurations wait alike)
                if tier and not args.warm_page_cache:
                    drop_page_cache(root / "serve")
                stages_before = ttft_stages(client)
                started = time.perf_counter()
                # The returning turn: the history and a new turn (the answer's ids are not in the API's reply; the
                # history's 2,000 tokens are whole blocks, the same ones either way).
                body = {"model": MODEL, "prompt": history + turn, "max_tokens": args.max_tokens,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}
                first_token_s, text = None, ""
                with client.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            delta = json.loads(line[6:])["choices"][0]["text"]
                            if first_token_s is None:
                                first_token_s = time.perf_counter() - started
                            text += delta
                assert first_token_s is not None
                ttft[name].append(first_token_s)
                answers[name].append(text)
                stages = {k: v - stages_before.get(k, 0.0) for k, v in ttft_stages(client).items()}
                print(f"serve, {name}, conversation {c}: returning-turn TTFT {first_token_s:.3f}s (the gateway's "
                      "stages: " + ", ".join(f"{k} {v:.3f}s" for k, v in stages.items() if v) + ")", flush=True)
            prefix = "splitserve:prefix_cache_hits_total{tier="
            hits = {k[len(prefix):-1]: v for k, v in metric_totals(client).items() if k.startswith(prefix)}
            print(f"serve, {name}: prefix_cache_hits_total by tier {hits}", flush=True)
        finally:
            server.stop()
    assert answers["no tier"] == answers["disk tier"], "the returning turns' texts differ with the tier"
    return ttft


def metric_totals(client) -> dict[str, float]:  # noqa: ANN001 - an httpx.Client on the gateway
    """Every sample of the gateway's /metrics summed over workers: under its name, and under `name{label=value}`
    for each of its other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            keys = [sample.name] + [f"{sample.name}{{{label}={value}}}" for label, value in sample.labels.items()
                                    if label != "worker"]
            for key in keys:
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def ttft_stages(client) -> dict[str, float]:  # noqa: ANN001 - an httpx.Client on the gateway
    """splitserve:ttft_stage_seconds_sum by stage, and the gateway's TTFT sum ("ttft"), from /metrics."""
    prefix = "splitserve:ttft_stage_seconds_sum{stage="
    totals = metric_totals(client)
    sums = {k[len(prefix):-1]: v for k, v in totals.items() if k.startswith(prefix)}
    sums["ttft"] = totals.get("splitserve:time_to_first_token_seconds_sum", 0.0)
    return sums


def busy_holder(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The busy-holder scenario (module docstring): per configuration, TTFT p50 / p90 (s), prefill tokens
    computed, peer fetch decisions and failures."""
    import httpx

    from bench.serve_process import Serve, aiperf, metric

    workload = ["--endpoint-type", "completions", "--streaming", "--use-server-token-count",
                "--num-prefix-prompts", str(args.families), "--prefix-prompt-length", str(args.prefix_tokens),
                "--synthetic-input-tokens-mean", str(TURN_TOKENS), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", "8", "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
                "--request-timeout-seconds", "900", "--random-seed", str(args.seed)]
    results: dict[str, dict[str, float]] = {}
    for name, flag in (("recompute", "--no-kv-peer-fetch"), ("peer fetch", "--kv-peer-fetch")):
        server = Serve(["--prefill-workers", "2", "--decode-workers", "1", "--routing-policy", args.busy_policy,
                        "--num-kv-blocks", str(args.busy_kv_blocks), "--max-model-len", "2048",
                        "--block-size", str(BLOCK_SIZE), "--dtype", "float32", flag])
        try:
            summary = aiperf(server.url, [*workload, "--request-rate", str(args.rate),
                                          "--request-count", str(args.requests)])
            with httpx.Client(base_url=server.url, timeout=60) as client:
                totals = metric_totals(client)
        finally:
            server.stop()
        hits = totals.get("splitserve:prefix_cache_hits_total", 0.0)
        results[name] = {
            "ttft_p50_s": metric(summary, "time_to_first_token", "p50") / 1e3,
            "ttft_p90_s": metric(summary, "time_to_first_token", "p90") / 1e3,
            "requests": metric(summary, "request_count"),
            "computed_tokens": totals.get("splitserve:prefix_cache_queries_total", 0.0) - hits,
            "peer_hit_tokens": totals.get("splitserve:prefix_cache_hits_total{tier=peer}", 0.0),
            "fetch_decisions": totals.get("splitserve:kv_peer_fetch_decisions_total{decision=fetch}", 0.0),
            "recompute_decisions": totals.get("splitserve:kv_peer_fetch_decisions_total{decision=recompute}", 0.0),
            "fetch_failures": totals.get("splitserve:kv_peer_fetch_failures_total", 0.0),
            # The fetches' mean wall (the gateway's TTFT stage: the fetcher's call, the holder's pin and send).
            "fetch_s_mean": (totals.get("splitserve:ttft_stage_seconds_sum{stage=peer_fetch}", 0.0)
                             / max(totals.get("splitserve:ttft_stage_seconds_count{stage=peer_fetch}", 0.0), 1.0)),
        }
        print(f"busy holder, {name}: {json.dumps(results[name])}", flush=True)
    base, fetch = results["recompute"], results["peer fetch"]
    print(f"\nbusy holder: prefill tokens computed {fetch['computed_tokens']:.0f} against "
          f"{base['computed_tokens']:.0f} ({fetch['computed_tokens'] / max(base['computed_tokens'], 1):.3f}x), "
          f"TTFT p50 {fetch['ttft_p50_s']:.3f}s against {base['ttft_p50_s']:.3f}s "
          f"({base['ttft_p50_s'] / max(fetch['ttft_p50_s'], 1e-9):.2f}x better)")
    return results


def report(title: str, ttft: dict[str, list[float]]) -> None:
    (base, base_s), (tier, tier_s) = ttft.items()
    b, t = statistics.median(base_s), statistics.median(tier_s)
    print(f"\n{title}: returning-turn TTFT median over {len(base_s)}: {base} {b:.3f}s, {tier} {t:.3f}s, "
          f"ratio {t / b:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dir", default=None, help="where the tiers live (default: a temporary directory)")
    p.add_argument("--warm-page-cache", action="store_true", help="leave the tier's files in the page cache")
    p.add_argument("--skip-restart", action="store_true")
    p.add_argument("--serve", action="store_true",
                   help="returning chats through a real `splitserve serve` (one colocated worker) instead")
    p.add_argument("--busy-holder", action="store_true",
                   help="the busy-holder scenario (peer fetch against recompute) through a real `splitserve serve`")
    p.add_argument("--families", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--rate", type=float, default=0.3, help="busy holder: requests per second (Poisson)")
    p.add_argument("--requests", type=int, default=40, help="busy holder: requests per configuration")
    p.add_argument("--busy-policy", default="least-loaded", help="busy holder: the gateway's --routing-policy")
    p.add_argument("--busy-kv-blocks", type=int, default=400, help="busy holder: each worker's --num-kv-blocks")
    args = p.parse_args()
    if args.busy_holder:
        busy_holder(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="kv-pool-") as tmp:
            report("serve, returning chats", serve_returning_chats(args, Path(tmp)))
        return
    checkpoint = load_checkpoint(str(resolve_model("smollm2-135m")), dtype=torch.float32)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kv-pool-") as tmp:
        root = Path(tmp)
        results = {"returning chats": returning_chats(args, checkpoint, root)}
        if not args.skip_restart:
            results["restart"] = restart(args, checkpoint, root)
    for title, ttft in results.items():
        report(title, ttft)


if __name__ == "__main__":
    main()
