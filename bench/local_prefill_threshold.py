"""What a local prefill costs the streams a decode worker is running: the measurement behind the default of
`--disagg-prefill-threshold` (conditional disaggregation).

    python bench/local_prefill_threshold.py [--batch 8] [--tokens 8,16,32,64,128,256] [--rounds 15]

A decode worker that prefills a prompt's uncached tail itself saves the KV handoff, but the step that runs the
tail also runs every stream's next token: each stream's inter-token latency grows by what the tail adds to that
step. On the real model (offline engine, one process, this machine's cores), with `--batch` streams decoding:

    baseline    a decode step of the batch alone (median of --rounds)
    with N      the same step with an N-token uncached prompt chunk beside it (median of --rounds)

and prints each step time and its ratio to the baseline. The default threshold is the largest N whose step stays
within 2x a plain decode step: a local prefill then delays the running streams by at most one token's time,
about what the remote path's handoff costs its own request (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", default="8,16,32,64,128,256")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader.model_registry import resolve_model
    from engine.request.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(resolve_model("smollm2-135m")), num_kv_blocks=2048,
                                    max_model_len=2048, num_threads=len(os.sched_getaffinity(0))))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    forever = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(args.batch):  # the running streams: 64-token prompts, decoding for the whole run
        engine.add_request(f"s{i}", [rng.randrange(vocab) for _ in range(64)], forever)
    for _ in range(4):
        engine.step()

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    def with_prefill(num_tokens: int, i: int) -> float:
        engine.add_request(f"p{num_tokens}-{i}", [rng.randrange(vocab) for _ in range(num_tokens)],
                           SamplingParams(temperature=0.0, max_tokens=1))
        return timed_step()  # the batch's decode tokens and the whole uncached prompt, in one step

    sizes = [int(x) for x in args.tokens.split(",")]
    baseline: list[float] = []
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(args.rounds):  # interleaved, so drift tilts no size
        baseline.append(timed_step())
        for n in sizes:
            samples[n].append(with_prefill(n, i))
    base = statistics.median(baseline)
    print(f"{args.batch} streams decoding; plain decode step {1000 * base:.1f} ms (median of {args.rounds})")
    print(f"{'tail tokens':>11} {'step ms':>8} {'x decode step':>14}")
    within = 0
    for n in sizes:
        step = statistics.median(samples[n])
        print(f"{n:>11} {1000 * step:8.1f} {step / base:14.2f}")
        if step <= 2 * base:
            within = n
    print(f"largest tail within 2x a decode step: {within} tokens")


if __name__ == "__main__":
    main()
