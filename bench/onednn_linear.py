"""Packed oneDNN GEMMs (engine/model/linear.py) vs torch's F.linear (MKL), at two levels, paired in one run.

1. Each of the model's GEMM shapes at 1 to 2048 rows, both ways alternately: GFLOP/s and the ratio.
2. The real engine on the offline workload, every forward pass run twice on the same inputs (oneDNN and MKL
   weights swapped in, in alternating order) and only the forward times summed: a paired comparison that the
   machine's drift from minute to minute cannot tilt. The two differ in summation order, so the outputs agree to
   float32 rounding (the largest difference is printed), not bit for bit.

    .venv/bin/python bench/onednn_linear.py [--num-prompts 60] [--skip-engine]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.offline_throughput import make_workload  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from engine.model.linear import Linear  # noqa: E402
from engine.model.llama import LayerWeights, LlamaModel  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def gemm_table(rounds: int = 3) -> None:
    print(f"{'gemm':8} {'rows':>5} {'F.linear GF/s':>14} {'oneDNN GF/s':>12} {'ratio':>6}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * k**-0.5
        packed = Linear(w)
        assert packed.packed is not None, "oneDNN packing is not available here"
        for rows in (1, 16, 256, 2048):
            x = torch.randn(rows, k)
            flops = 2 * rows * k * n
            reps = max(2, int(4e9 // flops))  # ~20 ms of work per timing
            best = {"mkl": float("inf"), "onednn": float("inf")}
            for _ in range(rounds):
                for label, fn in (("mkl", lambda: F.linear(x, w)), ("onednn", lambda: packed(x))):
                    fn()
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    best[label] = min(best[label], (time.perf_counter() - start) / reps)
            print(f"{name:8} {rows:5d} {flops / best['mkl'] / 1e9:14.0f} {flops / best['onednn'] / 1e9:12.0f} "
                  f"{best['mkl'] / best['onednn']:5.2f}x")


def unpacked_copy(model: LlamaModel) -> tuple[list[LayerWeights], Linear]:
    def plain(lin: Linear) -> Linear:
        return Linear(lin.dense_weight(), lin.bias, pack=False)

    layers = [
        dataclasses.replace(layer, qkv=plain(layer.qkv), o=plain(layer.o), gate_up=plain(layer.gate_up),
                            down=plain(layer.down))
        for layer in model.layers
    ]
    return layers, plain(model.lm_head)


def engine_run(num_prompts: int, seed: int) -> None:
    checkpoint = load_checkpoint(str(resolve_model("smollm2-135m")), dtype=torch.float32)
    work = make_workload(checkpoint.tokenizer, num_prompts, seed)
    engine = LLMEngine(
        EngineConfig(dtype="float32", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
                     kv_cache_memory_bytes=int(2.5 * (1 << 30))),
        checkpoint=checkpoint,
    )
    model = engine.runner.model
    assert model.lm_head.packed is not None, "the engine did not pack its weights"
    weights = {True: (model.layers, model.lm_head), False: unpacked_copy(model)}
    forward, compute_logits = model.forward, model.compute_logits
    seconds = {True: 0.0, False: 0.0}
    steps = 0
    max_diff = 0.0

    def use(onednn: bool) -> None:
        model.layers, model.lm_head = weights[onednn]

    def paired_forward(*a, **kw):  # noqa: ANN202
        nonlocal steps, max_diff
        outputs = {}
        for onednn in (True, False) if steps % 2 == 0 else (False, True):
            use(onednn)
            start = time.perf_counter()
            outputs[onednn] = forward(*a, **kw)
            seconds[onednn] += time.perf_counter() - start
        steps += 1
        max_diff = max(max_diff, (outputs[True] - outputs[False]).abs().max().item())
        use(True)  # the LM head that samples, and the step's result: oneDNN's
        return outputs[True]

    def paired_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = {}
        for onednn in (True, False) if steps % 2 == 0 else (False, True):
            use(onednn)
            start = time.perf_counter()
            out[onednn] = compute_logits(hidden)
            seconds[onednn] += time.perf_counter() - start
        use(True)
        return out[True]

    model.forward, model.compute_logits = paired_forward, paired_logits
    for i, (ids, out_len) in enumerate(work):
        engine.add_request(f"b{i}", ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    print(f"{len(work)} prompts, {steps} steps; largest |difference| of a final hidden state: {max_diff:.2e}")
    print(f"  F.linear (MKL)   {seconds[False]:7.1f} s of forward + LM head")
    print(f"  packed oneDNN    {seconds[True]:7.1f} s of forward + LM head")
    print(f"ratio oneDNN / MKL: {seconds[False] / seconds[True]:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-engine", action="store_true", help="only the per-shape GEMM table")
    args = p.parse_args()
    gemm_table()
    if not args.skip_engine:
        engine_run(args.num_prompts, args.seed)


if __name__ == "__main__":
    main()
