"""Where the engine runs: `EngineConfig.device` and `EngineConfig.dtype` made concrete, once, at start-up.

    device "auto" ──▶ "cuda" when torch sees a CUDA GPU, else "cpu"
    dtype  "auto" ──▶ "bfloat16" on cuda, "float32" on cpu (vLLM's default on GPU; our CPU kernels are float32)
    async_scheduling None ──▶ on with cuda (the host works while the device runs a step), off on cpu (no overlap)

`resolve_engine_config` returns the config with both made concrete, so everything downstream (the checkpoint's
dtype, the KV layout, the block-hash namespace) sees one device and one dtype name. It fails at once, before any
weight is read, when cuda is asked for and torch sees none (`DeviceUnavailableError`, a ValueError: the CLI prints
it as one line).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.config import EngineConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceUnavailableError(ValueError):
    """The configured device is not on this machine."""


def resolve_device(name: str) -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> a device this process can use. Raises DeviceUnavailableError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
            raise DeviceUnavailableError(
                f"--device {name}: no CUDA GPU is visible to this process (torch {torch.__version__}, {built}); "
                "use --device cpu or --device auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def resolve_dtype(name: str, device: torch.device) -> str:
    """"auto" -> "bfloat16" on cuda, "float32" on cpu; a concrete name is kept."""
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" else "float32"


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """`config` with `device` and `dtype` concrete (idempotent). Raises DeviceUnavailableError, and ValueError for
    a KV cache dtype the device cannot hold (fp8 is GPU-only)."""
    device = resolve_device(config.device)
    async_scheduling = device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
    resolved = dataclasses.replace(config, device=str(device), dtype=resolve_dtype(config.dtype, device),
                                   async_scheduling=async_scheduling)
    if resolved.kv_cache_dtype == "fp8" and device.type != "cuda":
        raise ValueError(f"--kv-cache-dtype fp8 needs a CUDA device; the engine runs on {device} (int8 works there)")
    return resolved
