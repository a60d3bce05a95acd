"""KV cache sizing (engine/memory_profile.py): `--gpu-memory-utilization`'s arithmetic and errors on plain numbers,
the flag and the config, the cpu engine's sizes unchanged, the profile forward run on cpu; and on a GPU (the `gpu`
marker), an engine's blocks within its share (the Llama-3.2-1B shape, dummy weights) and a too-small share refused before any request."""

from __future__ import annotations

import argparse
import gc
import logging
import math
from pathlib import Path

import pytest
import torch

from engine.config import CPU_KV_CACHE_MEMORY_BYTES, EngineConfig
from engine.engine_args import add_engine_args, engine_config_from_args
from engine.request.sampling_params import SamplingParams
from engine.memory_profile import (
    GIB,
    MemoryProfile,
    check_free_memory,
    kv_cache_bytes,
    num_kv_blocks_for,
    profile_forward,
)
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE

MIB = 1 << 20


def _profile(*, total: int = 80 * GIB, peak: int = 3 * GIB, non_torch: int = GIB // 2) -> MemoryProfile:
    return MemoryProfile(total_bytes=total, free_bytes_at_start=total, weights_bytes=GIB, peak_torch_bytes=peak,
                         non_torch_bytes=non_torch)


def test_kv_cache_bytes_is_the_share_less_the_peak_and_what_torch_does_not_see() -> None:
    assert kv_cache_bytes(total_bytes=80 * GIB, utilization=0.9, peak_torch_bytes=3 * GIB,
                          non_torch_bytes=GIB // 2) == 72 * GIB - 3 * GIB - GIB // 2
    assert kv_cache_bytes(total_bytes=1000, utilization=0.5, peak_torch_bytes=600, non_torch_bytes=0) == -100
    # memory given back outside torch since the baseline is not a credit
    assert kv_cache_bytes(total_bytes=1000, utilization=1.0, peak_torch_bytes=100, non_torch_bytes=-50) == 900


def test_the_blocks_are_the_whole_blocks_of_what_is_left() -> None:
    block_bytes = 3 * MIB
    num_blocks = num_kv_blocks_for(_profile(), utilization=0.9, block_bytes=block_bytes, block_size=16,
                                   max_model_len=8192)
    assert num_blocks == (72 * GIB - 3 * GIB - GIB // 2) // block_bytes == 23381
    # exactly one max_model_len request's worth is enough
    one_request = _profile(total=10 * GIB, peak=GIB, non_torch=0)
    left = 9 * GIB
    assert num_kv_blocks_for(one_request, utilization=1.0, block_bytes=left // 4, block_size=16, max_model_len=64) == 4


def test_a_share_that_cannot_hold_one_request_names_the_figures_and_the_flags() -> None:
    with pytest.raises(ValueError) as info:
        num_kv_blocks_for(_profile(total=80 * GIB, peak=3 * GIB, non_torch=GIB // 2), utilization=0.05,
                          block_bytes=64 * MIB, block_size=16, max_model_len=8192)
    message = str(info.value)
    assert "--gpu-memory-utilization 0.05 leaves 0.50 GiB for the KV cache" in message
    assert "80.00 GiB × 0.05 = 4.00 GiB, less 3.00 GiB peak" in message
    assert "one request of max_model_len=8192 needs 512 blocks" in message
    for flag in ("raise --gpu-memory-utilization", "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs"):
        assert flag in message


def test_a_share_smaller_than_the_peak_is_refused() -> None:
    with pytest.raises(ValueError, match=r"leaves -2\.\d\d GiB for the KV cache .* 0 blocks"):
        num_kv_blocks_for(_profile(total=80 * GIB, peak=3 * GIB, non_torch=0), utilization=0.01,
                          block_bytes=MIB, block_size=16, max_model_len=16)


def test_free_memory_below_the_share_at_start_is_refused() -> None:
    check_free_memory(free_bytes=72 * GIB, total_bytes=80 * GIB, utilization=0.9)  # exactly the share: fine
    with pytest.raises(ValueError, match=r"free GPU memory at start-up \(40\.00 GiB of 80\.00 GiB\) is less than "
                                         r"--gpu-memory-utilization 0\.9 asks for \(72\.00 GiB\)"):
        check_free_memory(free_bytes=40 * GIB, total_bytes=80 * GIB, utilization=0.9)


class _FakeCudaMemory:
    """torch.cuda's memory counters as plain numbers the test moves (the arithmetic of MemoryBaseline, on cpu)."""

    def __init__(self) -> None:
        self.total, self.free, self.allocated, self.reserved, self.peak = 80 * GIB, 79 * GIB, 5 * GIB, 6 * GIB, 9 * GIB

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, fn in {"empty_cache": lambda: None, "synchronize": lambda device=None: None,
                         "mem_get_info": lambda device=None: (self.free, self.total),
                         "memory_allocated": lambda device=None: self.allocated,
                         "memory_reserved": lambda device=None: self.reserved,
                         "max_memory_allocated": lambda device=None: self.peak,
                         "reset_peak_memory_stats": lambda device=None: setattr(self, "peak", self.allocated)}.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_the_baseline_counts_only_what_this_engine_added(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier engine's 5 GiB (allocated before the baseline, and its old peak) are not charged, nor the load's
    transient peak; the device's loss beyond torch's reserved growth is."""
    from engine.memory_profile import MemoryBaseline

    cuda = _FakeCudaMemory()
    cuda.install(monkeypatch)
    baseline = MemoryBaseline(torch.device("cuda"), utilization=0.9)
    cuda.allocated += GIB  # the weights
    cuda.peak = cuda.allocated + GIB  # the load's transient copies (q/k/v before their fused copy): not counted
    baseline.weights_loaded()
    cuda.peak = cuda.allocated + 2 * GIB  # the profile's activations
    cuda.reserved += 3 * GIB + 512 * MIB  # torch's cache grew by that
    cuda.free -= 3 * GIB + 512 * MIB + 300 * MIB  # and 300 MiB went outside torch (cuBLAS, modules)
    profile = baseline.measure()
    assert profile == MemoryProfile(total_bytes=80 * GIB, free_bytes_at_start=79 * GIB, weights_bytes=GIB,
                                    peak_torch_bytes=3 * GIB, non_torch_bytes=300 * MIB)
    cuda.free = 50 * GIB
    with pytest.raises(ValueError, match="another process"):
        MemoryBaseline(torch.device("cuda"), utilization=0.9)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_utilization_out_of_range_is_refused(utilization: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=utilization)


def test_the_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args([]))
    assert (default.gpu_memory_utilization, default.kv_cache_memory_bytes) == (0.9, None)
    given = engine_config_from_args(parser.parse_args(["--gpu-memory-utilization", "0.45", "--kv-cache-memory",
                                                       "256MiB"]))
    assert (given.gpu_memory_utilization, given.kv_cache_memory_bytes) == (0.45, 256 * MIB)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive"):
        EngineConfig(kv_cache_memory_bytes=0)


def test_a_cpu_engine_takes_2_gib_or_the_size_given_and_logs_its_blocks(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.llm import LLM

    assert CPU_KV_CACHE_MEMORY_BYTES == 2 * GIB
    # The cpu default, read where the engine reads it, made small: 2 GiB would be touched page by page here.
    monkeypatch.setattr("engine.engine_builder.CPU_KV_CACHE_MEMORY_BYTES", 3 * MIB)
    sizes = {**TINY_ENGINE, "num_kv_blocks": None, "device": "cpu", "gpu_memory_utilization": 0.001}
    with caplog.at_level(logging.INFO, logger="engine.engine_builder"):
        engine = LLM(model=str(tiny_model_dir), **sizes).engine  # type: ignore[arg-type]
    block_bytes = engine.runner.kv_cache[:, :, 0].nbytes
    assert engine.num_kv_blocks == 3 * MIB // block_bytes  # utilization is ignored on cpu
    assert engine.memory_profile is None
    assert (f"KV cache: {engine.num_kv_blocks} blocks of {TINY_ENGINE['block_size']} tokens "
            f"({engine.num_kv_blocks * block_bytes / GIB:.2f} GiB)") in caplog.text
    small = LLM(model=str(tiny_model_dir), **{**sizes, "kv_cache_memory_bytes": MIB}).engine  # type: ignore[arg-type]
    assert small.num_kv_blocks == MIB // block_bytes
    assert small.runner.kv_cache.nbytes <= MIB


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_profile_forward_runs_the_largest_step_as_max_model_len_chunks(
        tiny_checkpoint, kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On cpu with the torch backend (the GPU run covers the Triton one): the step is cut into max_model_len chunks,
    no cache block but the scratch one is touched, and the logits have the rows asked for."""
    from engine.attention.backend import get_attention_backend
    from engine.model.llama import LlamaModel

    mc = tiny_checkpoint.config
    attention = get_attention_backend("torch", scale=mc.head_dim**-0.5, device=torch.device("cpu"),
                                      kv_cache_dtype=kv_cache_dtype)
    model = LlamaModel(mc, tiny_checkpoint.weights, attention, max_positions=128)
    seen: dict[str, object] = {}
    forward, compute_logits = model.forward, model.compute_logits

    def spy_forward(input_ids, positions, kv_caches, meta):  # type: ignore[no-untyped-def]
        seen["chunks"] = [(c.query_start, c.query_len, c.context_len) for c in meta.prefills]
        seen["positions"] = positions.tolist()
        seen["num_cache_blocks"] = {kv.shape[1] for kv in kv_caches}
        return forward(input_ids, positions, kv_caches, meta)

    def spy_logits(hidden):  # type: ignore[no-untyped-def]
        seen["logit_rows"] = hidden.shape[0]
        return compute_logits(hidden)

    monkeypatch.setattr(model, "forward", spy_forward)
    monkeypatch.setattr(model, "compute_logits", spy_logits)
    profile_forward(model, num_tokens=300, max_model_len=128, num_logit_rows=40, block_size=4,
                    kv_cache_dtype=kv_cache_dtype)
    assert seen["chunks"] == [(0, 128, 128), (128, 128, 128), (256, 44, 44)]
    assert seen["positions"] == [*range(128), *range(128), *range(44)]
    assert seen["num_cache_blocks"] == {1}
    assert seen["logit_rows"] == 40


# -- on a GPU ------------------------------------------------------------------------------------------------------

_SHARE = 0.3
# The Llama-3.2-1B shape with dummy weights: its tokenizer is the byte-level stand-in, so nothing is read from disk
# (the dummy smollm2-135m shape reads the real GGUF for its tokenizer, and weights stay off the GPU machine).
_SHAPE = "llama-3.2-1b"


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_a_cuda_engine_sizes_its_kv_cache_to_its_share_and_frees_its_blocks() -> None:
    from engine.kv_cache_dtype import kv_block_bytes
    from engine.llm import LLM
    from engine.loader.dummy_weights import weight_shapes

    _release()
    allocated_before = torch.cuda.memory_allocated()
    free_before, total = torch.cuda.mem_get_info()
    llm = LLM(model=_SHAPE, load_format="dummy", device="cuda", max_model_len=512,
              gpu_memory_utilization=_SHARE)
    engine = llm.engine
    profile = engine.memory_profile
    assert profile is not None and profile.total_bytes == total
    block_bytes = kv_block_bytes(engine.model_config, engine.config.block_size, torch.bfloat16, "auto")
    assert engine.runner.kv_cache.nbytes == engine.num_kv_blocks * block_bytes
    share = int(_SHARE * total)
    # the arithmetic: every whole block that fits, and not one more
    used = engine.num_kv_blocks * block_bytes + profile.peak_torch_bytes + max(profile.non_torch_bytes, 0)
    assert used <= share < used + block_bytes
    # the weights were counted (to the allocator's rounding and the rotary tables), and the activations on top
    weights = sum(math.prod(shape) for shape in weight_shapes(engine.model_config).values()) * 2  # bfloat16
    assert weights <= profile.weights_bytes <= weights + 64 * MIB
    assert profile.peak_torch_bytes > profile.weights_bytes

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [16] * len(PROMPTS)
    assert engine.block_pool.num_used_blocks == 0
    # measured independently of the arithmetic: what torch held for this engine at its peak since its weights were
    # in place (weights, profile, KV cache, the steps), and what the device lost in all, stay within the share
    # (slack: non-torch memory the first steps add, e.g. the decode kernels' modules)
    assert torch.cuda.max_memory_allocated() - allocated_before <= share
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_after <= share + 256 * MIB
    del llm, engine
    _release()


@pytest.mark.gpu
def test_a_too_small_utilization_is_refused_before_any_request() -> None:
    from engine.llm import LLM

    _release()
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0\.001 leaves .* raise --gpu-memory-utilization"):
        LLM(model=_SHAPE, load_format="dummy", device="cuda", max_model_len=512, gpu_memory_utilization=0.001)
    _release()


@pytest.mark.gpu
def test_kv_cache_memory_given_on_cuda_wins_over_utilization() -> None:
    from engine.llm import LLM

    _release()
    llm = LLM(model=_SHAPE, load_format="dummy", device="cuda", max_model_len=512,
              kv_cache_memory_bytes=64 * MIB, gpu_memory_utilization=0.001)
    engine = llm.engine
    assert engine.memory_profile is None
    assert engine.num_kv_blocks == 64 * MIB // engine.runner.kv_cache[:, :, 0].nbytes
    assert math.ceil(512 / engine.config.block_size) <= engine.num_kv_blocks
    del llm, engine
    _release()
