"""Load an HF checkpoint directory: `config.json` plus `model.safetensors` or shards listed in
`model.safetensors.index.json`.

Both spellings of RoPE settings are read: transformers 5's `rope_parameters` (which also carries `rope_theta`)
and the older top-level `rope_theta` with `rope_scaling`. The weights are already in HF names and layouts;
loading them is a cast. As with every loader the result passes `weight_layout.check_weights`, and failures are
`ModelLoadError`s naming the file, except an unknown `model_type`, which is `UnsupportedArchitectureError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.loader.errors import ModelLoadError
from engine.loader.weight_layout import check_weights
from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling, UnsupportedArchitectureError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Qwen2 always puts biases on q/k/v; Llama and Mistral say so in "attention_bias" (which also means an o_proj
# bias, which the engine does not implement; `check_weights` then names the tensor it cannot place).
_ALWAYS_QKV_BIAS = frozenset({"qwen2"})
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a derived buffer some old checkpoints saved


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read ({err.strerror or err})") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(hf: dict[str, Any], source: Path) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(f"{source}: RoPE type {rope_type!r} is not supported (only default and llama3)")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def architecture_of(model_dir: Path) -> str:
    """config.json's model_type, refused by name (`UnsupportedArchitectureError`) unless the engine implements it."""
    source = model_dir / CONFIG_FILE
    model_type = read_json(source).get("model_type")
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{source}: no model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(model_type)
    return model_type


def config_from_hf(model_dir: Path, *, has_lm_head: bool) -> ModelConfig:
    """Build the `ModelConfig` from `model_dir/config.json` (and generation_config.json's stop ids, if any).

    `has_lm_head` settles tying when config.json does not say: a checkpoint without `lm_head.weight` is tied.
    """
    source = model_dir / CONFIG_FILE
    model_type = architecture_of(model_dir)
    hf = read_json(source)

    eos_ids = _ids(hf.get("eos_token_id"))
    generation = model_dir / GENERATION_CONFIG_FILE
    if generation.is_file():  # instruct models often list their end-of-turn ids only here
        eos_ids += [i for i in _ids(read_json(generation).get("eos_token_id")) if i not in eos_ids]
    tie = hf.get("tie_word_embeddings")
    try:
        rope_theta, rope_scaling = _rope(hf, source)
        num_heads = int(hf["num_attention_heads"])
        return ModelConfig(
            architecture=model_type,
            name=model_dir.resolve().name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_theta=rope_theta,
            max_position_embeddings=int(hf["max_position_embeddings"]),
            tie_word_embeddings=bool(tie) if tie is not None else not has_lm_head,
            attention_bias=model_type in _ALWAYS_QKV_BIAS or bool(hf.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            bos_token_id=_ids(hf.get("bos_token_id"))[0] if hf.get("bos_token_id") is not None else None,
            eos_token_ids=tuple(eos_ids),
        )
    except KeyError as err:
        raise ModelLoadError(f"{source}: missing required key {err.args[0]!r}") from err
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{source}: invalid value: {err}") from err


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: the shards an index names, or the single file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index}: names shard {file.name}, which is missing from {model_dir}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _read_safetensors(file: Path, dtype: torch.dtype | None, into: dict[str, torch.Tensor | None]) -> None:
    """Add `file`'s tensors to `into`, cast to `dtype`; with dtype None, only their names (a header read)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name in into:
                    raise ModelLoadError(f"{file}: tensor {name} also appears in another shard")
                into[name] = None if dtype is None else f.get_tensor(name).to(dtype).contiguous()
    except ModelLoadError:
        raise
    except Exception as err:  # safetensors raises its own error types for truncated or malformed files
        raise ModelLoadError(f"{file}: cannot read safetensors ({type(err).__name__}: {err})") from err


def load_safetensors_dir(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF checkpoint directory and return its config and weights (`dtype`, contiguous).

    The config is settled before any weight is read, so an unsupported or malformed checkpoint fails fast.
    A tied model's `lm_head.weight`, if the checkpoint saved one anyway, is dropped (see `weight_layout`).
    """
    model_dir = Path(path)
    if not (model_dir / CONFIG_FILE).is_file():
        raise ModelLoadError(f"{model_dir}: not an HF checkpoint directory (no {CONFIG_FILE})")
    architecture_of(model_dir)  # refuse an unsupported model before looking for its weights
    files = weight_files(model_dir)
    names: dict[str, torch.Tensor | None] = {}
    for file in files:
        _read_safetensors(file, None, names)
    config = config_from_hf(model_dir, has_lm_head="lm_head.weight" in names)

    loaded: dict[str, torch.Tensor | None] = {}
    for file in files:
        _read_safetensors(file, dtype, loaded)
    weights = {name: tensor for name, tensor in loaded.items() if tensor is not None}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(weights, config, str(model_dir))
    return config, weights
