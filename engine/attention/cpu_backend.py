"""The CPU backend: the torch backend with decode attention done by the C++ paged kernel, which reads KV blocks
in place instead of gathering them (see engine/kernels/cpu_paged_attention.py). Prefill stays on torch SDPA."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_paged_attention import paged_decode_attention


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return paged_decode_attention(
            q, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens, self.scale
        )
