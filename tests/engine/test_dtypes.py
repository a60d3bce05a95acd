"""The engine runs in bfloat16 as well as float32, on both attention backends, and agrees with itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from tests.engine.tiny_model import TINY_ENGINE

PROMPTS = ["hello world", "the quick brown fox jumps", "1 2 3 4 5 6 7 8 9"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bfloat16_generates_and_frees_every_block(tiny_model_dir: Path, torch_single_thread, backend: str) -> None:
    from engine.llm import LLM

    llm = LLM(model=str(tiny_model_dir), **{**TINY_ENGINE, "dtype": "bfloat16", "attention_backend": backend})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
    assert llm.engine.runner.kv_caches[0].dtype.is_floating_point
    assert str(llm.engine.runner.kv_caches[0].dtype) == "torch.bfloat16"
    assert llm.engine.block_pool.num_used_blocks == 0


def test_backends_agree_in_float32(tiny_model_dir: Path, torch_single_thread) -> None:
    from engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {
        backend: [o.token_ids for o in LLM(model=str(tiny_model_dir), **{**TINY_ENGINE, "attention_backend": backend})
                  .generate(PROMPTS, params)]
        for backend in ("cpu", "torch")
    }
    assert outs["cpu"] == outs["torch"]
