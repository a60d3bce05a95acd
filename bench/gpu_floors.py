"""The device's ceilings and a step's floors, for bench/gpu.py: timing helpers, the measured copy bandwidth and GEMM
rate, and the bytes and FLOPs a model's decode and prefill steps cannot do without (bench/gpu.py's docstring gives
the arithmetic)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from engine.model.config import ModelConfig


# -- timing ----------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median seconds of `fn` (CUDA events on cuda, perf_counter on cpu), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wall_s(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of `fn`, bounded by device synchronisations on both sides."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


# -- the device's own rates ----------------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, size_bytes: int) -> float:
    """Bytes/s of a device-to-device copy_ (bytes read + written)."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = median_s(lambda: dst.copy_(src), device, warmup=3, repeats=20 if device.type == "cuda" else 5)
    return 2 * size_bytes / seconds


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    seconds = median_s(lambda: a @ b, device, warmup=3, repeats=10 if device.type == "cuda" else 3)
    return 2 * n**3 / seconds


# -- model arithmetic ------------------------------------------------------------------------------------------------
def weight_bytes(weights: dict[str, torch.Tensor], config: ModelConfig) -> int:
    """Bytes a decode step reads of the weights: every tensor; an untied embedding only gathers B rows (ignored)."""
    return sum(t.numel() * t.element_size() for name, t in weights.items()
               if config.tie_word_embeddings or name != "model.embed_tokens.weight")


def non_embedding_params(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for name, t in weights.items() if name not in ("model.embed_tokens.weight", "lm_head.weight"))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def prefill_flops(config: ModelConfig, num_params: int, prompt_lens: Sequence[int]) -> float:
    """2 x params x tokens + causal attention (QK^T and PV: 4 x layers x heads x head_dim per query-key pair)."""
    dense = 2 * num_params * sum(prompt_lens)
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    return dense + 4 * config.num_layers * config.num_heads * config.head_dim * pairs
