"""`--load-format dummy` (vLLM's name): seeded random weights of a named architecture, so that the engine can run,
and be benchmarked, on model shapes whose weights are not on the machine. The shapes, their tokenizers and
identities: engine/loader/dummy_shapes.py (torch-free; re-exported here).

Weights: every matrix (and the Qwen2 q/k/v biases) normal with std 0.02 (the models' initializer_range), the
RMSNorm weights ones; drawn from one torch generator seeded by `seed` and the tensor's name, in order, directly in
the requested dtype and on the requested device (a GPU draws 1.5B values in milliseconds; "meta" allocates
nothing, for shape checks). Same name, seed, dtype and device: the same weights.
"""

from __future__ import annotations

import hashlib

import torch

from engine.loader.dummy_shapes import (  # noqa: F401 (re-exported: the names this module always had)
    DUMMY_SHAPES,
    byte_level_tokenizer,
    dummy_checkpoint_path,
    dummy_model_config,
    dummy_model_id,
    dummy_tokenizer,
    weight_shapes,
)
from engine.model.config import ModelConfig

INIT_STD = 0.02


def dummy_weights(
    config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Seeded random weights for `config` (see the module docstring)."""
    device = torch.device(device)
    weights: dict[str, torch.Tensor] = {}
    generator = None if device.type == "meta" else torch.Generator(device=device)
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if generator is not None:
            # Seeded per tensor: a tensor's values do not depend on which tensors come before it.
            generator.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little"))
            tensor.normal_(0.0, INIT_STD, generator=generator)
        weights[name] = tensor
    return weights
