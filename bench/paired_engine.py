"""The paired engine run behind bench/fused_elementwise.py and bench/onednn_linear.py.

The real engine runs the offline workload (bench/offline_throughput.make_workload) to the end, and every call of
the chosen model methods runs twice on the same inputs, once per variant, in alternating order; only those calls'
times are summed. A paired comparison: the machine's drift from minute to minute cannot tilt it. A second pass
writes the same KV slots as the first, so what the engine carries on with is the variant that ran last, which is
why `switch(True)` is restored and variant True's output returned after every pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.offline_throughput import make_workload
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader.checkpoint import load_checkpoint
from engine.loader.model_registry import resolve_model
from engine.model.llama import LlamaModel


@dataclass
class PairedResult:
    num_prompts: int
    steps: int  # calls of the first method (the forward pass: one per engine step)
    seconds: dict[bool, float]  # summed over every paired call, per variant


def run_paired(
    *,
    num_prompts: int,
    seed: int,
    make_switch: Callable[[LlamaModel], Callable[[bool], None]],
    methods: tuple[str, ...],
    compare: Callable[[torch.Tensor, torch.Tensor], None],
) -> PairedResult:
    """`make_switch(model)` returns `switch(variant)`, which puts variant True or False in place; `compare(a, b)`
    sees the first method's two outputs at every step (True's, False's)."""
    checkpoint = load_checkpoint(str(resolve_model("smollm2-135m")), dtype=torch.float32)
    work = make_workload(checkpoint.tokenizer, num_prompts, seed)
    engine = LLMEngine(
        EngineConfig(dtype="float32", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
                     kv_cache_memory_bytes=int(2.5 * (1 << 30))),
        checkpoint=checkpoint,
    )
    model = engine.runner.model
    switch = make_switch(model)
    seconds = {True: 0.0, False: 0.0}
    calls = dict.fromkeys(methods, 0)

    def paired(name: str, method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run_both(*a, **kw) -> torch.Tensor:  # noqa: ANN002, ANN003
            outputs = {}
            for variant in (True, False) if calls[name] % 2 == 0 else (False, True):
                switch(variant)
                start = time.perf_counter()
                outputs[variant] = method(*a, **kw)
                seconds[variant] += time.perf_counter() - start
            calls[name] += 1
            switch(True)
            if name == methods[0]:
                compare(outputs[True], outputs[False])
            return outputs[True]

        return run_both

    for name in methods:
        setattr(model, name, paired(name, getattr(model, name)))
    for i, (ids, out_len) in enumerate(work):
        engine.add_request(f"b{i}", ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return PairedResult(num_prompts=len(work), steps=calls[methods[0]], seconds=seconds)
