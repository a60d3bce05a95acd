"""A rank's slice of the weights (engine/distributed/sharding.py): shapes at the 1B shape, values on a small one, and
the slices put back together give the whole."""

from __future__ import annotations

import dataclasses

import torch

from engine.distributed.sharding import local_model_config, shard_weights, tp_shape
from engine.loader.dummy_shapes import DUMMY_SHAPES
from engine.loader.dummy_weights import dummy_weights


def test_llama_1b_shard_shapes_at_tp4() -> None:
    config = DUMMY_SHAPES["llama-3.2-1b"]
    shape = tp_shape(config, 4)
    weights = dummy_weights(config, dtype=torch.float32, device="meta")
    shard = shard_weights(weights, config, shape, 1)
    p = "model.layers.0."
    assert shard[p + "self_attn.q_proj.weight"].shape == (8 * 64, 2048)
    assert shard[p + "self_attn.k_proj.weight"].shape == (2 * 64, 2048)
    assert shard[p + "self_attn.o_proj.weight"].shape == (2048, 8 * 64)
    assert shard[p + "mlp.gate_proj.weight"].shape == (2048, 2048)
    assert shard[p + "mlp.down_proj.weight"].shape == (2048, 2048)
    assert shard["model.embed_tokens.weight"].shape == (32064, 2048)
    assert shard[p + "input_layernorm.weight"].shape == (2048,)
    local = local_model_config(config, shape)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (8, 2, 2048, 128256)


def test_slices_put_together_give_the_whole() -> None:
    config = dataclasses.replace(DUMMY_SHAPES["qwen2.5-1.5b"], num_layers=1, hidden_size=48, intermediate_size=64,
                                 num_heads=4, num_kv_heads=2, head_dim=12, vocab_size=101)
    weights = dummy_weights(config, dtype=torch.float32)
    shape = tp_shape(config, 4)  # KV heads replicated, each on two ranks; the vocabulary padded to 4 x 26
    shards = [shard_weights(weights, config, shape, r) for r in range(4)]
    p = "model.layers.0."

    def whole(name: str, dim: int = 0) -> bool:
        return torch.equal(torch.cat([s[p + name] for s in shards], dim), weights[p + name])

    assert whole("self_attn.q_proj.weight") and whole("self_attn.q_proj.bias")
    assert whole("self_attn.o_proj.weight", 1) and whole("mlp.down_proj.weight", 1)
    assert whole("mlp.gate_proj.weight") and whole("mlp.up_proj.weight")
    k = weights[p + "self_attn.k_proj.weight"]
    assert [torch.equal(s[p + "self_attn.k_proj.weight"], k[(r // 2) * 12 : (r // 2 + 1) * 12])
            for r, s in enumerate(shards)] == [True] * 4
    embed = torch.cat([s["model.embed_tokens.weight"] for s in shards])
    assert embed.shape == (104, 48)
    assert torch.equal(embed[:101], weights["model.embed_tokens.weight"]) and not embed[101:].any()
