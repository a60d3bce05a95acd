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
    from kv_transfer.reservation import ReservationSink, ReservationState
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(**{**TINY_ENGINE, "device": "cuda", "dtype": "bfloat16",  # type: ignore[arg-type]
                             "kv_cache_dtype": kv_cache_dtype})
    colocated, prefill, decode = (LLMEngine(config, tiny_checkpoint) for _ in range(3))
    graphs = kv_cache_dtype == "auto"  # an fp8 cache runs on the torch backend, eagerly
    assert (decode.runner.graphs is not None) == graphs
    layout = decode.kv_blocks.layout
    cuda = torch.device("cuda")
    sink = ReservationSink(layout, cuda)
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


def test_async_scheduling_gives_the_synchronous_tokens_with_cuda_graphs(tiny_checkpoint) -> None:
    """bfloat16 with CUDA graphs, async scheduling on and off (engine/core/overlap.py): greedy, seeded random and
    logprob rows give the same streams (a replay's input ids are the step in flight's tokens, fed on the device);
    the steps really overlapped; every block comes back. Records how many host syncs the launches of the steps
    scheduled ahead made (torch's sync debug mode; the target is 0: the one sync a step has is its read)."""
    import warnings

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    workload = [(f"r{i}", prompt, params) for i, prompt in enumerate(PROMPTS) for params in (
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=NUM_TOKENS, ignore_eos=True,
                       logprobs=2))]
    streams, syncs = {}, 0
    for async_scheduling in (False, True):
        config = EngineConfig(**{**TINY_ENGINE, "device": "cuda", "dtype": "bfloat16",  # type: ignore[arg-type]
                                 "async_scheduling": async_scheduling})
        engine = LLMEngine(config, tiny_checkpoint)
        assert engine.async_scheduling is async_scheduling and engine.runner.graphs is not None
        launch, placeholders, syncs_per_launch = engine.runner.launch, [], []

        def watched(scheduled, launch=launch, placeholders=placeholders,  # noqa: ANN001, ANN202
                    syncs_per_launch=syncs_per_launch):
            ahead = sum(item.takes_last_sample for item in scheduled.scheduled)
            placeholders.append(ahead)
            if not ahead:
                return launch(scheduled)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return launch(scheduled)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    syncs_per_launch.append(sum("synchroniz" in str(w.message) for w in caught))

        engine.runner.launch = watched
        for j, (request_id, prompt, params) in enumerate(workload):
            engine.add_request(f"{request_id}-{j}", prompt, params)
        outs: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(
                    (out.new_token_ids, out.finished, out.finish_reason, out.logprobs))
        streams[async_scheduling] = outs
        assert engine.block_pool.num_used_blocks == 0
        assert engine.runner.graphs.num_replays > 0
        assert (sum(placeholders) > 0) is async_scheduling
        syncs = sum(syncs_per_launch)
    _record("async scheduling with CUDA graphs", host_syncs_in_launches_ahead=syncs)
    assert streams[True].keys() == streams[False].keys()
    for request_id in streams[False]:
        got, want = streams[True][request_id], streams[False][request_id]
        assert [o[:3] for o in got] == [o[:3] for o in want], request_id
        for (*_, got_lp), (*_, want_lp) in zip(got, want, strict=True):  # the same device math, read back later
            assert (got_lp is None) == (want_lp is None)
            if got_lp is not None:
                assert [(lp.token_id, lp.rank) for lp in got_lp] == [(lp.token_id, lp.rank) for lp in want_lp]
