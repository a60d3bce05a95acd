"""The attention-backend interface: paged KV write + attention over block tables.

A backend owns no KV memory; the runner allocates one cache tensor per layer,
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, and passes it in. Implementations: `torch_backend`
(reference, runs anywhere); a Triton backend for GPUs plugs in behind the same call.
"""

from __future__ import annotations

from typing import Protocol

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


BACKENDS = ("auto", "cpu", "torch")


def get_attention_backend(name: str, *, scale: float) -> AttentionBackend:
    """"torch": the plain-torch reference; "cpu": torch plus the C++ paged decode kernel; "auto": "cpu" when the
    kernel builds on this machine, else "torch"."""
    if name == "auto":
        from engine.kernels.cpu_paged_attention import load_kernel

        name = "cpu" if load_kernel() is not None else "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(scale=scale)
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(scale=scale)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
