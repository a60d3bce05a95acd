"""The engine on a GPU (gpu-marked: they skip without CUDA): accuracy bounds of bfloat16 and of the quantized KV
caches there, and a prefill -> decode KV handoff between two engines on one GPU, device to device.

The bounds, over the test prompts (tests/engine/tiny_model.PROMPTS), 16 greedy tokens each; "agreeing tokens" and
the logit difference as in test_kv_cache_dtype.py (up to where an output first differs). Measured on an H200
(docs/benchmarks.md, "GPU"), asserted with margin:

    bfloat16 engine against the float32 one           >= 75% agreeing tokens, max |logit diff| < 0.5
    fp8 (e4m3) KV cache against the bfloat16 cache     >= 60% agreeing tokens, max |logit diff| < 1.0
    int8 KV cache against the bfloat16 cache           >= 75% agreeing tokens, max |logit diff| < 0.5

Set SPLITSERVE_GPU_FIGURES=path to have each test append what it measured (JSON lines).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from tests.engine.kv_harness import (
    agreement,
    greedy_with_logits,
    hand_off_prompt,
    steps_until_finished,
    transfer_link,
)
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE

pytestmark = pytest.mark.gpu

NUM_TOKENS = 16
TOTAL = NUM_TOKENS * len(PROMPTS)


def _record(name: str, **figures: object) -> None:
    path = os.environ.get("SPLITSERVE_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, "device": torch.cuda.get_device_name(), **figures}) + "\n")


def _engine(model_dir: Path, **overrides: object):
    from engine.llm import LLM

    # Eager: greedy_with_logits records the logits through compute_logits, which a replayed graph does not call.
    config = {**TINY_ENGINE, "device": "cuda", "enforce_eager": True, **overrides}
    return LLM(model=str(model_dir), **config).engine  # type: ignore[arg-type]


def _bound(name: str, reference, candidate, *, min_fraction: float, max_logit_diff: float) -> None:
    num_agreeing, max_diff = agreement(reference, candidate)
    _record(name, agreeing=num_agreeing, total=TOTAL, max_logit_diff=max_diff)
    assert sum(num_agreeing) >= min_fraction * TOTAL, num_agreeing
    assert 0 < max_diff < max_logit_diff  # > 0: the two really computed differently


def test_bfloat16_greedy_agrees_with_float32(tiny_model_dir: Path) -> None:
    reference = greedy_with_logits(_engine(tiny_model_dir, dtype="float32"), NUM_TOKENS)
    bf16 = _engine(tiny_model_dir, dtype="bfloat16")
    _bound("bfloat16 vs float32", reference, greedy_with_logits(bf16, NUM_TOKENS), min_fraction=0.75,
           max_logit_diff=0.5)
    assert bf16.block_pool.num_used_blocks == 0


@pytest.mark.parametrize(("kv_cache_dtype", "min_fraction", "max_logit_diff"), [("fp8", 0.6, 1.0),
                                                                                 ("int8", 0.75, 0.5)])
def test_a_quantized_cache_agrees_with_the_bfloat16_cache(tiny_model_dir: Path, kv_cache_dtype: str,
                                                          min_fraction: float, max_logit_diff: float) -> None:
    reference = greedy_with_logits(_engine(tiny_model_dir, dtype="bfloat16"), NUM_TOKENS)
    quantized = _engine(tiny_model_dir, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    _bound(f"{kv_cache_dtype} cache vs bfloat16 cache", reference, greedy_with_logits(quantized, NUM_TOKENS),
           min_fraction=min_fraction, max_logit_diff=max_logit_diff)
    assert quantized.block_pool.num_used_blocks == 0


@pytest.mark.parametrize(("transport", "sampling", "kv_cache_dtype"), [
    ("inproc", "greedy", "auto"), ("grpc", "greedy", "auto"), ("ipc", "greedy", "auto"), ("inproc", "seeded", "auto"),
    ("grpc", "seeded", "auto"),
    # fp8 blocks travel as their bytes
    ("inproc", "greedy", "fp8"), ("grpc", "greedy", "fp8"), ("ipc", "greedy", "fp8"),
])
def test_a_handoff_on_one_gpu_decodes_what_the_colocated_engine_decodes(tiny_checkpoint, transport: str,
                                                                        sampling: str, kv_cache_dtype: str) -> None:
    """A bfloat16 prefill engine hands its blocks to a decode engine on the same GPU (inproc: device to device,
    never through the host; ipc: the same through its staging buffer, which a receiver in the sender's process
    takes directly; grpc: over loopback, as between hosts); the decode engine, replaying its CUDA graphs,
    gives the colocated engine's tokens (greedy, or seeded random: the decode engine's device generator starts past
    the prefill engine's draw), and every block of all three engines comes back."""
    from decode_worker.reservation import DecodeKVSink, ReservationState
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(**{**TINY_ENGINE, "device": "cuda", "dtype": "bfloat16",  # type: ignore[arg-type]
                             "kv_cache_dtype": kv_cache_dtype})
    colocated, prefill, decode = (LLMEngine(config, tiny_checkpoint) for _ in range(3))
    graphs = kv_cache_dtype == "auto"  # an fp8 cache runs on the torch backend, eagerly
    assert (decode.runner.graphs is not None) == graphs
    layout = decode.kv_blocks.layout
    cuda = torch.device("cuda")
    sink = DecodeKVSink(layout, cuda)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    if sampling == "seeded":
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    with transfer_link(transport, sink, cuda) as (sender, endpoint):
        for i, prompt in enumerate(PROMPTS):
            colocated.add_request(f"r{i}", prompt, params)
            expected = steps_until_finished(colocated, f"r{i}")
            reservation, first_token = hand_off_prompt(prefill, decode, sender, sink, endpoint, f"r{i}", prompt,
                                                       params)
            assert reservation.state is ReservationState.COMMITTED
            decode.commit_remote(f"r{i}", first_token, None)
            assert steps_until_finished(decode, f"r{i}") == expected
        assert not graphs or decode.runner.graphs.num_replays > 0
    for engine in (colocated, prefill, decode):
        assert engine.block_pool.num_used_blocks == 0
