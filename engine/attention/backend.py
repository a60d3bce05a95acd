"""The attention-backend interface: paged KV write + attention over block tables.

A backend owns no KV memory; the runner allocates one cache tensor per layer,
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, and passes it in. Implementations: `torch_backend`
(reference, runs anywhere), `cpu_backend` (the C++ paged decode kernel), `triton_backend` (GPU), and
`int8_kv.Int8TorchAttentionBackend` for an int8 cache (whose per-layer cache is an `Int8KVCache`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v at `meta.slot_mapping`, then attend causally over each request's context."""
        ...


@runtime_checkable
class RotaryAttentionBackend(Protocol):
    """A backend that can also apply rotary itself, fused into its KV store (the Triton one): the model calls
    `forward_rotary` instead of rotating q and k and calling `forward`, one launch fewer per layer."""

    def forward_rotary(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary NOT applied; rotated in place
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotary NOT applied; not written
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        positions: torch.Tensor,  # [num_tokens]
        cos_cache: torch.Tensor,  # [max_positions, head_dim] (`RotaryEmbedding.cos`, neox layout)
        sin_cache: torch.Tensor,  # [max_positions, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """`forward` of q and k rotated at `positions`: the rotated k is what the cache keeps."""
        ...


BACKENDS = ("auto", "cpu", "torch", "triton")


def get_attention_backend(
    name: str, *, scale: float, device: torch.device | None = None, kv_cache_dtype: str = "auto"
) -> AttentionBackend:
    """Chosen once, at start-up. "torch": the plain-torch reference (any device; it also casts to and from an fp8
    cache); "cpu": torch plus the C++ paged decode kernel; "triton": the Triton kernels (cuda, or CPU under
    TRITON_INTERPRET=1). "auto": on cuda "triton" when triton imports, else "torch"; on cpu "cpu" when the C++
    kernel builds here, else "torch". An int8 cache takes the int8 torch backend (the kernels read float caches
    only): "auto" and "torch" choose it; naming another backend with int8 is an error."""
    device = device or torch.device("cpu")
    if kv_cache_dtype == "int8":
        if name not in ("auto", "torch"):
            raise ValueError(f"--kv-cache-dtype int8 runs on the torch attention backend only, not {name!r}")
        from engine.attention.int8_kv import Int8TorchAttentionBackend

        return Int8TorchAttentionBackend(scale=scale)
    if kv_cache_dtype == "fp8" and name == "auto":
        name = "torch"  # the kernels read float caches of the model's dtype only
    if name == "auto" and device.type == "cuda":
        import importlib.util

        name = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    elif name == "auto":
        from engine.kernels.cpu_paged_attention import load_kernel

        name = "cpu" if load_kernel() is not None else "torch"
    if name in ("cpu", "triton") and kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} runs on the torch attention backend only, not {name!r}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on cpu only, not {device}")
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(scale=scale)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(scale=scale)
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(scale=scale)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
