"""The Triton attention backend inside the engine (the GPU path's attention), held to the torch backend: on CPU it
runs under the interpreter (this directory's conftest), on a GPU compiled. Fresh prefills, prefix-cache hits
(a prefill over cached context) and decodes all go through it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from engine import SamplingParams
from tests.engine.tiny_model import TINY_ENGINE

# The second prompt repeats the first and goes on: its first blocks are a prefix-cache hit, so its prefill attends
# over cached context.
PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "The quick brown fox jumps over the lazy dog. Then it ran"]


def _greedy(model_dir: Path, device: str, backend: str) -> tuple[list[list[int]], int, int]:
    from engine.llm import LLM

    llm = LLM(model=str(model_dir), **{**TINY_ENGINE, "device": device, "attention_backend": backend})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params)
    second = llm.generate(PROMPTS[1], params)
    hits = llm.engine.kv_cache.prefix_hits_tokens
    return [first[0].token_ids, second[0].token_ids], hits, llm.engine.block_pool.num_used_blocks


def test_triton_backend_matches_torch_in_the_engine(tiny_model_dir: Path, device, torch_single_thread) -> None:
    torch_out, torch_hits, _ = _greedy(tiny_model_dir, device.type, "torch")
    triton_out, triton_hits, num_used = _greedy(tiny_model_dir, device.type, "triton")
    assert triton_hits == torch_hits > 0  # the second prefill did attend over cached blocks
    assert triton_out == torch_out
    assert num_used == 0
