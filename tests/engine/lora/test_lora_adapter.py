"""Loading PEFT adapters (engine/lora/adapter.py): the fused layers' pairs, and every adapter that cannot be served
refused at load with one error naming it and the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.lora.adapter import LoRAError, load_lora_adapter
from tests.engine.lora.peft_adapter import lora_weights, make_adapter, write_adapter
from tests.engine.tiny_model import TINY_DIMS

LAYERS = TINY_DIMS["num_hidden_layers"]


def load(path: Path, config, max_lora_rank: int = 16):
    return load_lora_adapter("ad", path, config, max_lora_rank=max_lora_rank)


def test_fused_pairs_compute_each_modules_delta(tiny_checkpoint, tmp_path):
    base, config = tiny_checkpoint.weights, tiny_checkpoint.config
    path = make_adapter(tmp_path / "a", base, LAYERS, targets=("q_proj", "v_proj", "down_proj"), rank=4, alpha=8)
    adapter = load(path, config)
    assert adapter.scaling == 2.0 and adapter.rank == 4
    assert adapter.target_modules == ("down_proj", "q_proj", "v_proj")
    assert sorted(adapter.layers[0]) == ["down", "qkv"]  # o and gate_up untargeted: no pair
    raw = lora_weights(base, LAYERS, rank=4, targets=("q_proj", "v_proj", "down_proj"), seed=0, b_std=0.5)
    x = torch.randn(3, config.hidden_size)
    pair = adapter.layers[1]["qkv"]
    delta = (x @ pair.a.T) @ pair.b.T
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    key = "base_model.model.model.layers.1.self_attn.{}.lora_{}.weight"
    want_q = 2.0 * (x @ raw[key.format("q_proj", "A")].T) @ raw[key.format("q_proj", "B")].T
    want_v = 2.0 * (x @ raw[key.format("v_proj", "A")].T) @ raw[key.format("v_proj", "B")].T
    torch.testing.assert_close(delta[:, :q], want_q)
    assert torch.count_nonzero(delta[:, q : q + kv]) == 0  # k untargeted
    torch.testing.assert_close(delta[:, q + kv :], want_v)


def test_rslora_scales_by_the_square_root_of_the_rank(tiny_checkpoint, tmp_path):
    weights = lora_weights(tiny_checkpoint.weights, LAYERS, rank=4, targets=("q_proj",), seed=0, b_std=0.1)
    path = write_adapter(tmp_path / "rs", weights, rank=4, alpha=8, targets=("q_proj",), use_rslora=True)
    assert load(path, tiny_checkpoint.config).scaling == 4.0
    assert load(path, tiny_checkpoint.config).digest == load(path, tiny_checkpoint.config).digest


def broken(tmp_path: Path, base, kind: str) -> Path:
    weights = lora_weights(base, LAYERS, rank=4, targets=("q_proj", "o_proj"), seed=0, b_std=0.1)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    config: dict[str, object] = {}
    if kind == "nan":
        weights[key.format("B")][0, 0] = float("nan")
    elif kind == "unpaired":
        del weights[key.format("B")]
    elif kind == "shape":
        weights[key.format("A")] = torch.zeros(4, 7)
    elif kind == "embedding":
        weights["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(4, 8)
    elif kind == "layer":
        weights["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    elif kind in ("use_dora", "modules_to_save", "bias", "rank_pattern"):
        config = {"use_dora": True, "modules_to_save": ["lm_head"], "bias": "all", "rank_pattern": {"q_proj": 8}}
        config = {kind: config[kind]}
    return write_adapter(tmp_path / kind, weights, rank=4, alpha=8, targets=("q_proj",), **config)


@pytest.mark.parametrize("kind, match", [
    ("nan", "layer 0 q_proj holds NaN or infinite values"),
    ("unpaired", "layer 0 q_proj has lora_A without its pair"),
    ("shape", r"layer 0 q_proj has A \[4, 7\] and B \[64, 4\]; this model and r=4 need \[4, 64\] and \[64, 4\]"),
    ("embedding", "embed_tokens.lora_A.weight' is not a LoRA weight of a Llama projection"),
    ("layer", "names layer 9; the model has 2"),
    ("use_dora", "DoRA is not supported"),
    ("modules_to_save", "modules_to_save .* is not supported"),
    ("bias", "LoRA biases are not supported"),
    ("rank_pattern", "per-module ranks"),
])
def test_adapters_that_cannot_be_served_are_refused_by_name(tiny_checkpoint, tmp_path, kind, match):
    with pytest.raises(LoRAError, match=f"LoRA adapter 'ad'.*{match}"):
        load(broken(tmp_path, tiny_checkpoint.weights, kind), tiny_checkpoint.config)


def test_missing_unreadable_and_pickled_adapters(tiny_checkpoint, tmp_path):
    config = tiny_checkpoint.config
    with pytest.raises(LoRAError, match="is not a directory"):
        load(tmp_path / "absent", config)
    path = make_adapter(tmp_path / "a", tiny_checkpoint.weights, LAYERS, rank=4)
    with pytest.raises(LoRAError, match="rank 4, above --max-lora-rank 2"):
        load(path, config, max_lora_rank=2)
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{trunc")
    with pytest.raises(LoRAError, match="cannot read"):
        load(path, config)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(LoRAError, match="adapter_model.bin is a pickle, which is never loaded"):
        load(path, config)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not valid JSON"):
        load(path, config)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 0}))
    with pytest.raises(LoRAError, match="r must be a positive integer"):
        load(path, config)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING", "r": 4}))
    with pytest.raises(LoRAError, match="peft_type 'PREFIX_TUNING' is not LORA"):
        load(path, config)
