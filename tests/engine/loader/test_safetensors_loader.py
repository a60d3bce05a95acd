"""HF checkpoint directories: single-file and sharded round trips, config translation, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.loader.errors import ModelLoadError
from engine.loader.safetensors_loader import INDEX_FILE, load_safetensors_dir
from engine.model.config import UnsupportedArchitectureError
from tests.engine.loader.tiny_checkpoints import TinyModel, build_tiny_model, expected_config_for


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_round_trip_matches_hf_state_dict(tiny_model: TinyModel, tmp_path: Path, max_shard_size: str | None) -> None:
    model_dir = tmp_path / tiny_model.variant
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    tiny_model.model.save_pretrained(model_dir, **kwargs)
    assert (model_dir / INDEX_FILE).is_file() == (max_shard_size is not None)

    config, weights = load_safetensors_dir(model_dir)

    assert config == expected_config_for(tiny_model, tiny_model.variant)
    expected = tiny_model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def _saved(tmp_path: Path, variant: str = "llama_tied") -> Path:
    model_dir = tmp_path / variant
    build_tiny_model(variant).model.save_pretrained(model_dir)
    return model_dir


def _edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_dtype_cast(tmp_path: Path) -> None:
    _, weights = load_safetensors_dir(_saved(tmp_path), dtype=torch.float16)

    assert all(w.dtype == torch.float16 and w.is_contiguous() for w in weights.values())


def test_legacy_rope_keys_and_eos_list(tmp_path: Path) -> None:
    model_dir = _saved(tmp_path)
    legacy_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    _edit_config(model_dir, rope_parameters=None, rope_theta=500000.0, rope_scaling=legacy_rope,
                 eos_token_id=[2, 7], head_dim=16)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))

    config, _ = load_safetensors_dir(model_dir)

    assert config.rope_theta == 500000.0 and config.rope_scaling is not None
    assert config.rope_scaling.factor == 8.0 and config.rope_scaling.original_max_position_embeddings == 8192
    assert config.eos_token_ids == (2, 7, 9)


def test_tying_inferred_from_weights_when_config_is_silent(tmp_path: Path) -> None:
    model_dir = _saved(tmp_path, "llama_untied_rope3")
    _edit_config(model_dir, tie_word_embeddings=None)

    config, weights = load_safetensors_dir(model_dir)

    assert not config.tie_word_embeddings and "lm_head.weight" in weights


def test_unsupported_model_type_is_refused_by_name(tmp_path: Path) -> None:
    model_dir = _saved(tmp_path)
    _edit_config(model_dir, model_type="gpt_neox")

    with pytest.raises(UnsupportedArchitectureError, match="'gpt_neox'"):
        load_safetensors_dir(model_dir)


def test_unsupported_rope_type_is_refused(tmp_path: Path) -> None:
    model_dir = _saved(tmp_path)
    _edit_config(model_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})

    with pytest.raises(ModelLoadError, match="'yarn'"):
        load_safetensors_dir(model_dir)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    model_dir = tmp_path / "sharded"
    build_tiny_model("llama_tied").model.save_pretrained(model_dir, max_shard_size="40KB")
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()

    with pytest.raises(ModelLoadError, match=shard.name):
        load_safetensors_dir(model_dir)


def test_truncated_safetensors_is_refused(tmp_path: Path) -> None:
    model_dir = _saved(tmp_path)
    weights_file = model_dir / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:5000])

    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_safetensors_dir(model_dir)


def test_missing_config_key_is_named(tmp_path: Path) -> None:
    model_dir = _saved(tmp_path)
    _edit_config(model_dir, num_hidden_layers=None)

    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        load_safetensors_dir(model_dir)
