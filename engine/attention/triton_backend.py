"""The GPU backend: the Triton kernels of engine/kernels/triton/ behind the attention-backend call.

    store_kv                   the step's new K/V into the paged cache by slot (`forward`)
    rotary_store_kv            rotary on q and k, and that store, in one launch (`forward_rotary`, the model's path
                               on cuda)
    paged_decode_attention     the decode rows (one query each), GQA-grouped, split-K over long contexts
    paged_prefill_attention    every prefill chunk in one launch: causal over a cached prefix and itself

The kernels take any float cache dtype the model runs in. They also run on CPU tensors under TRITON_INTERPRET=1,
which is how the suite checks this backend against the torch one on a machine without a GPU.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kernels.triton.paged_decode_attention import paged_decode_attention
from engine.kernels.triton.paged_prefill_attention import paged_prefill_attention
from engine.kernels.triton.rotary_store_kv import rotary_store_kv
from engine.kernels.triton.store_kv import store_kv


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, *, scale: float) -> None:
        self.scale = scale
        # Built once per step (the first layer), reused by every other layer.
        self._prefill_args: tuple[AttentionMetadata | None, tuple[torch.Tensor, torch.Tensor, int] | None] = (
            None, None)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        store_kv(k, v, kv_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta)

    def forward_rotary(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], unrotated; rotated in place
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], unrotated; not written
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        positions: torch.Tensor,  # [num_tokens]
        cos_cache: torch.Tensor,  # [max_positions, head_dim]
        sin_cache: torch.Tensor,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """`forward` with the rotary before it fused into the store (attention.backend.RotaryAttentionBackend)."""
        rotary_store_kv(q, k, v, kv_cache, meta.slot_mapping, positions, cos_cache, sin_cache)
        return self._attend(q, kv_cache, meta)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q over the cache, the step's K/V already in it (the kernels read K/V from the cache only)."""
        num_decode = meta.num_decode_tokens
        # The grid is sized by the block tables' width, never by the lengths' values: no host sync, so a CUDA graph
        # captures it (its tables are max_model_len wide; partitions past a row's length exit at once).
        max_seq_len = meta.decode_block_tables.shape[-1] * kv_cache.shape[2]
        if not meta.prefills:  # decodes only (every step a CUDA graph replays): q as it comes (a view of qkv), no copy
            return paged_decode_attention(q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                                          max_seq_len=max_seq_len)
        q = q.contiguous()
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = paged_decode_attention(
                q[:num_decode], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                max_seq_len=max_seq_len)
        if meta.prefills:
            cu_seqlens_q, context_lens, max_query_len = self._prefill_arguments(meta)
            assert meta.prefill_block_tables is not None, "the triton backend needs prefill_block_tables"
            out[num_decode:] = paged_prefill_attention(
                q[num_decode:], kv_cache, meta.prefill_block_tables, cu_seqlens_q, context_lens, self.scale,
                max_query_len=max_query_len)
        return out

    def _prefill_arguments(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self._prefill_args[0] is not meta:
            first = meta.num_decode_tokens
            cu = [0] + [c.query_start + c.query_len - first for c in meta.prefills]
            device = meta.slot_mapping.device
            self._prefill_args = (meta, (
                torch.tensor(cu, dtype=torch.int64).to(device),  # [num_prefills + 1]
                torch.tensor([c.context_len for c in meta.prefills], dtype=torch.int64).to(device),
                max(c.query_len for c in meta.prefills),
            ))
        assert self._prefill_args[1] is not None
        return self._prefill_args[1]
