"""The HF weight layout every loader produces: names and shapes implied by a `ModelConfig`.

Both loaders end by calling `check_weights`, so the model code can index the dict without checks of its own:
the names are exactly `expected_shapes(config)`'s keys and each tensor has the listed shape. Linear weights are
[out_features, in_features] as in `torch.nn.Linear`. `lm_head.weight` is present if and only if the embeddings
are not tied; a tied model reads `model.embed_tokens.weight` for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from engine.loader.errors import ModelLoadError
from engine.model.config import ModelConfig

if TYPE_CHECKING:
    from engine.kernels.quantized_weight import QuantizedWeight


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name the model reads, mapped to its shape."""
    hidden, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_out, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_out)
        if config.attention_bias:
            shapes[f"{prefix}.self_attn.q_proj.bias"] = (q_out,)
            shapes[f"{prefix}.self_attn.k_proj.bias"] = (kv_out,)
            shapes[f"{prefix}.self_attn.v_proj.bias"] = (kv_out,)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def check_weights(weights: Mapping[str, torch.Tensor | QuantizedWeight], config: ModelConfig, source: str) -> None:
    """Raise `ModelLoadError` naming `source` unless `weights` has exactly the expected names and shapes and
    only finite values (a `QuantizedWeight`: its logical [out, in] shape; its scales were checked when it was made).
    No trained model has a NaN or infinite weight; one means a corrupt file (a damaged
    GGUF type or scale decodes to garbage that is often non-finite) or a dtype too narrow for the values."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise ModelLoadError(f"{source}: missing {len(missing)} weight(s) the config implies, e.g. {missing[:5]}")
    if unexpected:
        raise ModelLoadError(
            f"{source}: {len(unexpected)} weight(s) this architecture has no use for: {unexpected[:5]}"
        )
    for name, shape in expected.items():
        weight = weights[name]
        if not isinstance(weight, torch.Tensor):  # a QuantizedWeight
            if (weight.out_features, weight.in_features) != shape:
                raise ModelLoadError(f"{source}: weight {name} has shape {(weight.out_features, weight.in_features)}, "
                                     f"the config implies {shape}")
            continue
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: weight {name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )
        # Any NaN or inf makes the float32 sum non-finite, and finite weights never sum anywhere near 3e38;
        # one reduction is far cheaper than an element-wise isfinite over every weight.
        if not bool(torch.isfinite(weights[name].sum(dtype=torch.float32))):
            raise ModelLoadError(
                f"{source}: weight {name} holds NaN or infinite values in {weights[name].dtype} "
                "(corrupt file, or values out of range for the requested dtype)"
            )
