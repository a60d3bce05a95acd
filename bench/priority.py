"""Priority scheduling: interactive requests arriving into a batch backlog, `--scheduling-policy fcfs` against
`priority`, one engine each, in the same run (rounds alternate fcfs, priority, fcfs, ...).

Workload (SmolLM2-135M, float32, real text): `--batch` background requests (priority 5) queued at once, each a
`--batch-prompt`-token prompt decoding `--batch-output` tokens; and `--interactive` requests (priority 0), a
`--interactive-prompt`-token prompt and `--interactive-output` tokens, arriving every `--interval` seconds from the
start. Under fcfs every priority is 0 (the policy takes no other), so the interactive requests queue behind the
backlog; under priority they start at once, displacing the lowest running request when the batch is full.

Printed per policy (medians over rounds): the interactive requests' TTFT (arrival -> first token) p50 / p90 and
end-to-end p50, the whole run's output tokens/s and wall time, preemptions; then priority / fcfs ratios. Greedy,
EOS ignored: both policies produce exactly the same tokens (checked).

    .venv/bin/python bench/priority.py                    # the run recorded in docs/benchmarks.md
    .venv/bin/python bench/priority.py --rounds 1 --batch 16 --interactive 4   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from tests.engine.prompts import long_prompt  # noqa: E402

BATCH_PRIORITY, INTERACTIVE_PRIORITY = 5, 0


def workload(tokenizer, args: argparse.Namespace) -> list[tuple[str, list[int], int, int, float]]:
    """(request id, prompt ids, output tokens, priority, arrival s from the start), by arrival."""
    corpus = tokenizer.encode(long_prompt(min_words=6000), add_special_tokens=False)
    work = []
    for i in range(args.batch):
        start = (i * 97) % (len(corpus) - args.batch_prompt)
        work.append((f"batch-{i}", corpus[start:start + args.batch_prompt], args.batch_output, BATCH_PRIORITY, 0.0))
    for i in range(args.interactive):
        start = (i * 131 + 7) % (len(corpus) - args.interactive_prompt)
        work.append((f"interactive-{i}", corpus[start:start + args.interactive_prompt], args.interactive_output,
                     INTERACTIVE_PRIORITY, (i + 1) * args.interval))
    return work


def run_round(checkpoint, work, policy: str, args: argparse.Namespace) -> dict[str, object]:
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=2048, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=policy,
                                    kv_cache_memory_bytes=1 << 30), checkpoint=checkpoint)
    pending = sorted(work, key=lambda w: w[4])
    arrival, first, done, tokens = {}, {}, {}, {}
    began = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - began
        while pending and pending[0][4] <= now:
            rid, ids, out, priority, _ = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True,
                                    priority=priority if policy == "priority" else 0)
            engine.add_request(rid, ids, params)
            arrival[rid], tokens[rid] = time.monotonic(), []
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][4] - (time.monotonic() - began)))
            continue
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.monotonic()
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = time.monotonic()
    wall = time.monotonic() - began
    interactive = [rid for rid, *_ in work if rid.startswith("interactive")]
    ttft = sorted(first[r] - arrival[r] for r in interactive)
    return {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "e2e_p50_s": statistics.median(done[r] - arrival[r] for r in interactive),
        "tokens_per_s": sum(len(t) for t in tokens.values()) / wall,
        "wall_s": wall,
        "preemptions": engine.scheduler.num_preemptions,
        "tokens": tokens,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds per policy, alternating")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--batch-prompt", type=int, default=256)
    p.add_argument("--batch-output", type=int, default=96)
    p.add_argument("--interactive", type=int, default=12)
    p.add_argument("--interactive-prompt", type=int, default=64)
    p.add_argument("--interactive-output", type=int, default=16)
    p.add_argument("--interval", type=float, default=1.5, help="seconds between interactive arrivals")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(str(resolve_model("smollm2-135m")), dtype=torch.float32)
    work = workload(checkpoint.tokenizer, args)
    results: dict[str, list[dict[str, object]]] = {"fcfs": [], "priority": []}
    for r in range(args.rounds):
        for policy in ("fcfs", "priority"):
            result = run_round(checkpoint, work, policy, args)
            results[policy].append(result)
            print(f"round {r + 1} {policy:8s}: interactive TTFT p50 {result['ttft_p50_s']:.3f} s, "
                  f"p90 {result['ttft_p90_s']:.3f} s, e2e p50 {result['e2e_p50_s']:.3f} s; "
                  f"{result['tokens_per_s']:.1f} tok/s over {result['wall_s']:.1f} s; "
                  f"{result['preemptions']} preemptions", flush=True)
    same = all(a["tokens"] == b["tokens"] for a in results["fcfs"] for b in results["priority"])
    print(f"\nthe same tokens under both policies: {same}")

    def med(policy: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in results[policy])  # type: ignore[arg-type]

    print(f"{'':28s}{'fcfs':>10s}{'priority':>10s}{'ratio':>9s}")
    for key, label in (("ttft_p50_s", "interactive TTFT p50 (s)"), ("ttft_p90_s", "interactive TTFT p90 (s)"),
                       ("e2e_p50_s", "interactive e2e p50 (s)"), ("tokens_per_s", "output tokens/s"),
                       ("wall_s", "wall (s)"), ("preemptions", "preemptions")):
        fcfs, prio = med("fcfs", key), med("priority", key)
        ratio = f"{prio / fcfs:.3f}x" if fcfs else "-"
        print(f"{label:28s}{fcfs:10.3f}{prio:10.3f}{ratio:>9s}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
