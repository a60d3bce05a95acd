"""Llama-3 RoPE divisors: ours against transformers', and recovering the parameters from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.loader.rope_scaling import infer_llama3_scaling, llama3_divisors
from engine.model.config import RopeScaling

HEAD_DIM = 128
THETA = 500000.0
LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _hf_divisors(scaling: RopeScaling, head_dim: int = HEAD_DIM, theta: float = THETA) -> np.ndarray:
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_parameters=rope,
                         max_position_embeddings=131072)
    scaled = LlamaRotaryEmbedding(config).inv_freq.to(torch.float64).numpy()
    base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return base / scaled


def test_divisors_match_transformers() -> None:
    np.testing.assert_allclose(llama3_divisors(LLAMA31, THETA, HEAD_DIM), _hf_divisors(LLAMA31), rtol=1e-6)


def test_llama31_parameters_are_recovered_from_float32_divisors() -> None:
    stored = _hf_divisors(LLAMA31).astype(np.float32)  # as llama.cpp writes rope_freqs.weight

    assert infer_llama3_scaling(stored, THETA, HEAD_DIM, 8192) == LLAMA31


def test_unknown_original_context_still_reproduces_the_frequencies() -> None:
    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    stored = _hf_divisors(scaling).astype(np.float32)

    inferred = infer_llama3_scaling(stored, THETA, HEAD_DIM, original_context=4096)

    assert inferred is not None and inferred.factor == 32.0
    np.testing.assert_allclose(llama3_divisors(inferred, THETA, HEAD_DIM), stored, rtol=1e-5)


def test_all_ones_means_no_scaling() -> None:
    assert infer_llama3_scaling(np.ones(HEAD_DIM // 2, np.float32), THETA, HEAD_DIM) is None


@pytest.mark.parametrize("divisors", [np.linspace(1.0, 3.0, HEAD_DIM // 2)[::-1], np.full(HEAD_DIM // 2, 0.5),
                                      np.ones(HEAD_DIM // 4)])
def test_divisors_that_are_not_llama3_are_refused(divisors: np.ndarray) -> None:
    with pytest.raises(ValueError):
        infer_llama3_scaling(divisors, THETA, HEAD_DIM)
