"""What serving LoRA adapters costs: decode throughput of the base model against the same workload under adapters,
one engine each, in the same run (rounds alternate base, one adapter, four adapters, ...).

Workload (SmolLM2-135M, float32, `--threads` torch threads): `--streams` requests queued at once, each a
`--prompt`-token slice of a public-domain text decoding `--output` tokens (greedy, EOS ignored). Configurations:

    base        no adapter (the engine built with --enable-lora and one adapter loaded, which no request names)
    lora-1      every request under one adapter
    lora-4      the requests spread over four adapters (--max-loras 4): each step runs four adapter segments

Adapters are random PEFT adapters of rank `--rank` on all seven projections (tests/engine/lora/peft_adapter.py):
what an adapter costs does not depend on its values. Printed per configuration (medians over rounds): output
tokens/s and the decode step's mean time; then each LoRA configuration's throughput over base's.

    .venv/bin/python bench/lora.py                                # the runs recorded in docs/benchmarks.md
    .venv/bin/python bench/lora.py --streams 1 --rounds 1         # a quick look at one stream
"""

from __future__ import annotations

import argparse
import os
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
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from tests.engine.lora.peft_adapter import make_adapter  # noqa: E402
from tests.engine.prompts import long_prompt  # noqa: E402

CONFIGS = ("base", "lora-1", "lora-4")


def run_round(checkpoint, adapters: dict[str, Path], prompts: list[list[int]], config: str,
              args: argparse.Namespace) -> tuple[float, float]:
    """(output tokens/s, mean decode step ms) of one configuration's run."""
    modules = tuple((name, str(path)) for name, path in adapters.items())
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=2048, max_num_seqs=max(args.streams, 1),
                                    kv_cache_memory_bytes=1 << 30, enable_lora=True, lora_modules=modules,
                                    max_loras=4, max_lora_rank=args.rank, enable_prefix_caching=False),
                       checkpoint=checkpoint)
    names = sorted(adapters)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    for i, ids in enumerate(prompts):
        lora = {"base": None, "lora-1": names[0], "lora-4": names[i % 4]}[config]
        engine.add_request(f"r{i}", ids, params, lora_name=lora)
    began = time.perf_counter()
    steps: list[float] = []
    tokens = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        if all(out.token_ids for out in outs):  # every request past its prompt: a decode step
            steps.append(time.perf_counter() - start)
        tokens += sum(len(out.new_token_ids) for out in outs)
    wall = time.perf_counter() - began
    assert engine.block_pool.num_used_blocks == 0
    return tokens / wall, statistics.mean(steps[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(str(resolve_model("smollm2-135m")), dtype=torch.float32)
    corpus = checkpoint.tokenizer.encode(long_prompt(min_words=4000), add_special_tokens=False)
    prompts = [corpus[(i * 97) % (len(corpus) - args.prompt):][: args.prompt] for i in range(args.streams)]
    layers = checkpoint.config.num_layers
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"a{k}": make_adapter(Path(tmp) / f"a{k}", checkpoint.weights, layers, rank=args.rank,
                                          alpha=2 * args.rank, seed=k, b_std=0.02) for k in range(4)}
        results: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
        for _ in range(args.rounds):
            for config in CONFIGS:
                results[config].append(run_round(checkpoint, adapters, prompts, config, args))
    print(f"SmolLM2-135M float32, {args.threads} threads, {args.streams} streams x {args.prompt}+{args.output} "
          f"tokens, adapters of rank {args.rank} on all 7 projections, median of {args.rounds} rounds")
    base = statistics.median(r[0] for r in results["base"])
    for config in CONFIGS:
        tps = statistics.median(r[0] for r in results[config])
        step = statistics.median(r[1] for r in results[config])
        print(f"  {config:7s} {tps:8.1f} tok/s   decode step {step:6.2f} ms   {tps / base:5.3f}x base")


if __name__ == "__main__":
    main()
