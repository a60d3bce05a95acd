"""PEFT-format LoRA adapters for tests, and the reference they are checked against: the same deltas merged into
the base weights (W + scaling * B @ A, what PEFT's merge_and_unload computes).

    adapter_config.json           peft_type LORA, r, lora_alpha, target_modules, bias "none"
    adapter_model.safetensors     base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight

A is seeded ~N(0, 1/in); B ~N(0, `b_std`) (PEFT starts B at zero; a trained adapter's is not), so the adapter
moves the logits enough to change greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def lora_weights(base: dict[str, torch.Tensor], num_layers: int, *, rank: int, targets: tuple[str, ...], seed: int,
                 b_std: float) -> dict[str, torch.Tensor]:
    """PEFT-named A and B for every targeted projection, shaped by the base weights."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        for module in targets:
            w = base[f"model.layers.{i}.{_PARENT[module]}.{module}.weight"]
            key = f"base_model.model.model.layers.{i}.{_PARENT[module]}.{module}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=gen) * w.shape[1] ** -0.5
            out[f"{key}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=gen) * b_std
    return out


def write_adapter(directory: Path, weights: dict[str, torch.Tensor], *, rank: int, alpha: float,
                  targets: tuple[str, ...], **config: object) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM", **config}
    (directory / "adapter_config.json").write_text(json.dumps(settings), encoding="utf-8")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "adapter_model.safetensors"))
    return directory


def make_adapter(directory: Path, base: dict[str, torch.Tensor], num_layers: int, *, rank: int = 4,
                 alpha: float = 8.0, targets: tuple[str, ...] = ALL_MODULES, seed: int = 0, b_std: float = 0.5
                 ) -> Path:
    weights = lora_weights(base, num_layers, rank=rank, targets=targets, seed=seed, b_std=b_std)
    return write_adapter(directory, weights, rank=rank, alpha=alpha, targets=targets)


def merged(base: dict[str, torch.Tensor], adapter_dir: Path) -> dict[str, torch.Tensor]:
    """`base` with the adapter's deltas merged in (a new dict; the tensors it does not touch are shared)."""
    from safetensors.torch import load_file

    settings = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = settings["lora_alpha"] / settings["r"]
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    out = dict(base)
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        b = tensors[key.replace("lora_A", "lora_B")]
        out[name] = base[name] + scaling * (b.double() @ a.double()).to(base[name].dtype)
    return out
