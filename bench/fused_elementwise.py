"""The fused elementwise kernels (RoPE, RMSNorm's scaling, SiLU-and-multiply; engine/kernels/cpu_elementwise.py)
vs the torch ops they replace, inside the real engine on the offline workload, step by step.

Both give the same bits, so every forward pass runs twice on the same inputs (writing the same KV to the same
slots), once each way in alternating order (bench/paired_engine.py), and only the forward times are summed: a
paired comparison that the machine's drift from minute to minute cannot tilt. The outputs of the two passes are
checked equal every step.

    .venv/bin/python bench/fused_elementwise.py [--num-prompts 60]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.paired_engine import run_paired  # noqa: E402
from engine.model import llama, rope  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    fused_ops = llama.load_elementwise
    assert fused_ops() is not None, "the fused kernels did not build"

    def make_switch(model):  # noqa: ANN001, ANN202
        def use(fused: bool) -> None:
            loader = fused_ops if fused else (lambda: None)
            llama.load_elementwise = loader
            rope.load_elementwise = loader

        return use

    def compare(fused: torch.Tensor, plain: torch.Tensor) -> None:
        assert torch.equal(fused, plain), "the fused kernels changed a bit"

    result = run_paired(num_prompts=args.num_prompts, seed=args.seed, make_switch=make_switch, methods=("forward",),
                        compare=compare)
    seconds = result.seconds
    print(f"{result.num_prompts} prompts, {result.steps} steps, every pair of outputs bit-identical")
    print(f"  torch ops      {seconds[False]:7.1f} s of forward")
    print(f"  fused kernels  {seconds[True]:7.1f} s of forward")
    print(f"ratio fused / torch: {seconds[False] / seconds[True]:.3f}x")


if __name__ == "__main__":
    main()
