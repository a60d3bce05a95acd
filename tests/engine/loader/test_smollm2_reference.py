"""The real SmolLM2-135M GGUF, fetched by name, against transformers' own GGUF loader (gguf's reference
dequantization plus its own undoing of llama.cpp's q/k permutation)."""

from __future__ import annotations

import pytest
import torch

from engine.loader.checkpoint import load_weights_and_config
from engine.loader.model_registry import resolve_model


@pytest.mark.slow
def test_every_weight_equals_transformers_gguf_loader(hf_reference) -> None:
    path = resolve_model("smollm2-135m")  # network on first use; the cache afterwards

    config, weights = load_weights_and_config(path)
    reference = hf_reference  # transformers' GGUF loader, float32 (tests/conftest.py)

    hf = reference.config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (hf.num_hidden_layers, hf.hidden_size) == (30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size, config.max_position_embeddings) == (49152, 1536, 8192)
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings and not config.attention_bias and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))

    expected = reference.state_dict()
    expected.pop("lm_head.weight")  # tied: the same tensor as the embeddings, which our dict omits
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
