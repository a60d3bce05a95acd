"""Rotary position embeddings (HF "rotate_half" layout: the first and second halves of each head pair up).

cos/sin are tabulated once for every position up to max_model_len. Each entry is the float32 product
position * inv_freq, exactly as HF computes it per call, so the table changes no bit of the result.
"""

from __future__ import annotations

import math

import torch

from engine.kernels.cpu_elementwise import load_elementwise
from engine.model.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq  # [head_dim / 2]
    # Llama 3: leave high frequencies alone, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    def __init__(
        self, *, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.half = head_dim // 2

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of the tables for `positions`: looked up once per step, shared by every layer."""
        return self.cos[positions], self.sin[positions]  # [T, head_dim] each

    def __call__(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim] -> rotated.

        float32 on CPU is rotated in place by the fused kernel (the same bits as the torch expression below, in one
        pass instead of five): the caller's q and k must be its own to overwrite. Otherwise rotated copies."""
        cos, sin = cos_sin
        kernel = load_elementwise() if q.dtype == torch.float32 and q.device.type == "cpu" else None
        if kernel is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            kernel.rope_(q, cos, sin)
            kernel.rope_(k, cos, sin)
            return q, k
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, head_dim]
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., self.half :], x[..., : self.half]), dim=-1)
