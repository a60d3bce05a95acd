"""The fused elementwise kernels (RoPE, RMSNorm's scaling, SiLU-and-multiply; engine/kernels/cpu_elementwise.py)
vs the torch ops they replace, inside the real engine on the offline workload, step by step.

Both give the same bits, so every forward pass runs twice on the same inputs (writing the same KV to the same
slots), once each way in alternating order, and only the forward times are summed: a paired comparison that the
machine's drift from minute to minute cannot tilt. The outputs of the two passes are checked equal every step.

    .venv/bin/python bench/fused_elementwise.py [--num-prompts 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.offline_throughput import make_workload  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from engine.model import llama, rope  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    checkpoint = load_checkpoint(str(resolve_model("smollm2-135m")), dtype=torch.float32)
    work = make_workload(checkpoint.tokenizer, args.num_prompts, args.seed)
    engine = LLMEngine(
        EngineConfig(dtype="float32", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
                     kv_cache_memory_bytes=int(2.5 * (1 << 30))),
        checkpoint=checkpoint,
    )
    fused_ops = llama.load_elementwise
    assert fused_ops() is not None, "the fused kernels did not build"

    def use(fused: bool) -> None:
        loader = fused_ops if fused else (lambda: None)
        llama.load_elementwise = loader
        rope.load_elementwise = loader

    model = engine.runner.model
    forward = model.forward
    seconds = {True: 0.0, False: 0.0}
    steps = 0

    def paired_forward(*a, **kw):  # noqa: ANN202
        nonlocal steps
        outputs = {}
        for fused in (True, False) if steps % 2 == 0 else (False, True):
            use(fused)
            start = time.perf_counter()
            outputs[fused] = forward(*a, **kw)
            seconds[fused] += time.perf_counter() - start
        steps += 1
        assert torch.equal(outputs[True], outputs[False]), "the fused kernels changed a bit"
        return outputs[True]

    model.forward = paired_forward
    for i, (ids, out_len) in enumerate(work):
        engine.add_request(f"b{i}", ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    print(f"{len(work)} prompts, {steps} steps, every pair of outputs bit-identical")
    print(f"  torch ops      {seconds[False]:7.1f} s of forward")
    print(f"  fused kernels  {seconds[True]:7.1f} s of forward")
    print(f"ratio fused / torch: {seconds[False] / seconds[True]:.3f}x")


if __name__ == "__main__":
    main()
