"""The model's fused GPU forward (`LlamaModel._forward_fused`: the embedding gathered by the first RMSNorm, rotary
fused into the Triton backend's KV store) gives the engine the same greedy tokens as the same forward with rotary
as its own launch, and as the plain forward. On CPU the Triton kernels run under the interpreter (this directory's
conftest) with the fused forward switched on by hand (the engine turns it on for cuda only); the gpu-marked test
runs it as the engine chooses it there, eager and with CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from engine import SamplingParams  # noqa: E402
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE  # noqa: E402


def _greedy(model_dir: Path, device: str, *, dtype: str, fused: bool, rotary_in_attention: bool,
            max_tokens: int, enforce_eager: bool = True) -> list[list[int]]:
    from engine.llm import LLM

    graphs = {} if enforce_eager else {"cuda_graph_sizes": [1, 2, 4]}
    llm = LLM(model=str(model_dir), **{**TINY_ENGINE, "device": device, "dtype": dtype, "attention_backend": "triton",
                                       "enforce_eager": enforce_eager, **graphs})
    assert (llm.engine.runner.graphs is None) == enforce_eager
    model = llm.engine.runner.model
    assert model.rotary_in_attention  # the Triton backend fuses it: the engine's default
    model.fused_kernels = fused
    model.rotary_in_attention = rotary_in_attention
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert llm.engine.block_pool.num_used_blocks == 0
    if not enforce_eager:  # the decode steps were replays of the captured (fused) forward
        assert llm.engine.runner.graphs.num_replays >= max_tokens - 1
    return tokens


def test_only_the_triton_backend_fuses_rotary() -> None:
    """The model asks the backend (attention.backend.RotaryAttentionBackend): the torch backends of the fp8 and
    int8 caches keep rotary as its own launch before their store."""
    from engine.attention.backend import RotaryAttentionBackend, get_attention_backend

    assert isinstance(get_attention_backend("triton", scale=1.0), RotaryAttentionBackend)
    for name, kv_cache_dtype in (("torch", "auto"), ("torch", "fp8"), ("auto", "int8")):
        backend = get_attention_backend(name, scale=1.0, kv_cache_dtype=kv_cache_dtype)
        assert not isinstance(backend, RotaryAttentionBackend), backend.name


def test_fused_forward_matches_unfused_on_cpu(tiny_model_dir: Path, torch_single_thread) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the gpu-marked test below covers a CUDA machine")
    run = dict(dtype="float32", max_tokens=3)
    fused = _greedy(tiny_model_dir, "cpu", fused=True, rotary_in_attention=True, **run)
    assert fused == _greedy(tiny_model_dir, "cpu", fused=True, rotary_in_attention=False, **run)
    assert fused == _greedy(tiny_model_dir, "cpu", fused=False, rotary_in_attention=False, **run)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_rotary_store_greedy_equals_unfused_on_gpu(tiny_model_dir: Path, dtype: str) -> None:
    run = dict(dtype=dtype, max_tokens=16)
    unfused = _greedy(tiny_model_dir, "cuda", fused=True, rotary_in_attention=False, **run)
    assert _greedy(tiny_model_dir, "cuda", fused=True, rotary_in_attention=True, **run) == unfused
    # The engine as it starts on cuda: graphs captured over the fused forward.
    assert _greedy(tiny_model_dir, "cuda", fused=True, rotary_in_attention=True, enforce_eager=False, **run) == unfused
