"""Packed oneDNN GEMMs (engine/model/linear.py) vs torch's F.linear (MKL), at two levels, paired in one run.

1. Each of the model's GEMM shapes at 1 to 2048 rows, both ways alternately: GFLOP/s and the ratio.
2. The real engine on the offline workload (bench/paired_engine.py), every forward pass and LM head run twice on
   the same inputs (oneDNN and MKL weights swapped in, in alternating order) and only their times summed: a paired
   comparison that the machine's drift from minute to minute cannot tilt. The two differ in summation order, so
   the outputs agree to float32 rounding (the largest difference is printed), not bit for bit.

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

from bench.paired_engine import run_paired  # noqa: E402
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
    max_diff = 0.0

    def make_switch(model: LlamaModel):  # noqa: ANN202
        assert model.lm_head.packed is not None, "the engine did not pack its weights"
        weights = {True: (model.layers, model.lm_head), False: unpacked_copy(model)}

        def use(onednn: bool) -> None:
            model.layers, model.lm_head = weights[onednn]

        return use

    def compare(onednn: torch.Tensor, mkl: torch.Tensor) -> None:
        nonlocal max_diff
        max_diff = max(max_diff, (onednn - mkl).abs().max().item())

    result = run_paired(num_prompts=num_prompts, seed=seed, make_switch=make_switch,
                        methods=("forward", "compute_logits"), compare=compare)
    seconds = result.seconds
    print(f"{result.num_prompts} prompts, {result.steps} steps; largest |difference| of a final hidden state: "
          f"{max_diff:.2e}")
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
