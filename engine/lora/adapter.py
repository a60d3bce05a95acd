"""A LoRA adapter as PEFT saves one (`adapter_config.json` + `adapter_model.safetensors`), loaded for our fused
layers. No pickle: a `.bin` adapter is refused (torch.load runs code from the file).

PEFT computes, for a targeted linear layer W: y = x W^T + scaling * (x A^T) B^T, A [r, in], B [out, r],
scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Our layers fuse q/k/v and gate/up
(engine/model/llama.py), so each fused layer gets one pair:

    A = [A_q; A_k; A_v]           [r_q + r_k + r_v, hidden]   the targeted ones only
    B = block diagonal            [q + 2 kv, r_q + r_k + r_v]  each B_m (times its scaling) in its module's rows

and the delta of every targeted module comes out of two GEMMs, with zeros where a module is not targeted. What
PEFT can save that this does not run is refused by name at load (DoRA, LoRA biases, modules_to_save, per-module
rank or alpha patterns, embedding or LM-head adapters), as are weights that do not fit the model, a rank above
--max-lora-rank, and NaN or infinite values.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.loader.errors import ModelLoadError
from engine.loader.safetensors_loader import read_json
from engine.model.config import ModelConfig
from engine.request.lora import LoRAError

__all__ = ["LoRAAdapter", "LoRAError", "LoRAPair", "load_lora_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A PEFT module name -> (our fused layer, its part in it, in order)
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
FUSED = ("qkv", "o", "gate_up", "down")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json keys whose non-default value asks for something this does not compute
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (full copies of layers)",
            "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
            "fan_in_fan_out": "fan_in_fan_out weights", "layers_to_transform": "layers_to_transform",
            "layer_replication": "layer_replication"}


@dataclass(frozen=True, eq=False)
class LoRAPair:
    """One fused layer's delta: y += (x A^T) B^T. a: [R, in], b: [out, R] (the scaling folded in)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, eq=False)  # one adapter is one object (hashed by identity, as the scheduler counts them)
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest module rank
    scaling: float
    digest: str  # of its config and weights: namespaces its KV block hashes (kv_transfer/block_hash.py)
    target_modules: tuple[str, ...]
    # per layer: fused layer name -> its pair (absent: no module of that layer targeted)
    layers: tuple[dict[str, LoRAPair], ...]

    def to(self, device: torch.device, dtype: torch.dtype) -> LoRAAdapter:
        layers = tuple({k: LoRAPair(p.a.to(device, dtype), p.b.to(device, dtype)) for k, p in layer.items()}
                       for layer in self.layers)
        return LoRAAdapter(name=self.name, path=self.path, rank=self.rank, scaling=self.scaling, digest=self.digest,
                           target_modules=self.target_modules, layers=layers)


def load_lora_adapter(name: str, path: str | Path, config: ModelConfig, *, max_lora_rank: int) -> LoRAAdapter:
    """Load the PEFT adapter directory `path` for a model of `config` (its whole shape: TP 1), as float32 on the CPU.
    Raises LoRAError naming the adapter and the problem."""
    where = Path(path)
    if not where.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory (a PEFT adapter: {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE})")
    settings = _read_config(name, where / CONFIG_FILE)
    weights_file = where / WEIGHTS_FILE
    if not weights_file.is_file():
        pickled = " (adapter_model.bin is a pickle, which is never loaded: save with safe_serialization)" if (
            where / "adapter_model.bin").exists() else ""
        raise LoRAError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path}{pickled}")
    rank = settings["r"]
    if rank > max_lora_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_lora_rank}")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    pairs = _read_pairs(name, weights_file, config, rank)
    layers = tuple({fused: _fuse(fused, layer, config, scaling) for fused in FUSED
                    if any(MODULES[m][0] == fused for m in layer)} for layer in pairs)
    targets = sorted({module for layer in pairs for module in layer})
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling, digest=_digest(where),
                       target_modules=tuple(targets), layers=layers)


def _read_config(name: str, file: Path) -> dict[str, Any]:
    try:
        settings = read_json(file)
    except ModelLoadError as err:  # unreadable, not JSON, not an object: named with the file
        raise LoRAError(f"LoRA adapter {name!r}: {err}") from err
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key, what in _REFUSED.items():
        if settings.get(key) not in (None, False, {}, []):
            raise LoRAError(f"LoRA adapter {name!r}: {what} is not supported ({key} = {settings[key]!r})")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: LoRA biases are not supported (bias = {settings['bias']!r})")
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    return settings


def _read_pairs(name: str, file: Path, config: ModelConfig, rank: int) -> list[dict[str, tuple[torch.Tensor, ...]]]:
    """Per layer: PEFT module name -> (A, B), every shape checked against the model."""
    found: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                match = _KEY.match(key)
                if match is None or match.group(2) not in MODULES:
                    raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a Llama "
                                    f"projection ({', '.join(MODULES)}); embedding and LM-head adapters are not "
                                    "supported")
                layer = int(match.group(1))
                if layer >= config.num_layers:
                    raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} names layer {layer}; the model has "
                                    f"{config.num_layers}")
                found[layer].setdefault(match.group(2), {})[match.group(3)] = f.get_tensor(key).float()
    except LoRAError:
        raise
    except Exception as err:  # a truncated or malformed safetensors file
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {file} ({err})") from err
    if not any(found):
        raise LoRAError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    out_sizes, in_sizes = _module_shapes(config)
    pairs: list[dict[str, tuple[torch.Tensor, ...]]] = []
    for i, layer in enumerate(found):
        checked: dict[str, tuple[torch.Tensor, ...]] = {}
        for module, ab in layer.items():
            if set(ab) != {"A", "B"}:
                raise LoRAError(f"LoRA adapter {name!r}: layer {i} {module} has lora_{''.join(ab)} without its pair")
            a, b = ab["A"], ab["B"]
            want_a, want_b = (rank, in_sizes[module]), (out_sizes[module], rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise LoRAError(f"LoRA adapter {name!r}: layer {i} {module} has A {list(a.shape)} and B "
                                f"{list(b.shape)}; this model and r={rank} need {list(want_a)} and {list(want_b)}")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise LoRAError(f"LoRA adapter {name!r}: layer {i} {module} holds NaN or infinite values")
            checked[module] = (a, b)
        pairs.append(checked)
    return pairs


def _module_shapes(c: ModelConfig) -> tuple[dict[str, int], dict[str, int]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": c.hidden_size, "gate_proj": c.intermediate_size,
           "up_proj": c.intermediate_size, "down_proj": c.hidden_size}
    inp = {"q_proj": c.hidden_size, "k_proj": c.hidden_size, "v_proj": c.hidden_size, "o_proj": q,
           "gate_proj": c.hidden_size, "up_proj": c.hidden_size, "down_proj": c.intermediate_size}
    return out, inp


def _fuse(fused: str, layer: dict[str, tuple[torch.Tensor, ...]], config: ModelConfig, scaling: float) -> LoRAPair:
    """The fused layer's A (the targeted parts' A stacked) and block-diagonal B (each part's B in its rows)."""
    out_sizes, _ = _module_shapes(config)
    parts = sorted((m for m in MODULES if MODULES[m][0] == fused), key=lambda m: MODULES[m][1])
    targeted = [m for m in parts if m in layer]
    a = torch.cat([layer[m][0] for m in targeted])
    b = torch.zeros(sum(out_sizes[m] for m in parts), a.shape[0])
    row = col = 0
    for m in parts:
        if m in layer:
            r = layer[m][0].shape[0]
            b[row : row + out_sizes[m], col : col + r] = layer[m][1] * scaling
            col += r
        row += out_sizes[m]
    return LoRAPair(a.contiguous(), b)


def _digest(where: Path) -> str:
    """What two workers holding the same adapter agree on, whatever they call it: its config and weights' bytes."""
    digest = hashlib.sha256()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        with open(where / file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return "sha256:" + digest.hexdigest()[:24]
