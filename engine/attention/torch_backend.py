"""Paged attention in plain torch: the reference backend, and the CPU one.

Decode tokens are attended in one batched matmul over their gathered, padded contexts; prefill chunks one by one
with SDPA (causal; a chunk after cached context gets an explicit offset-causal mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata, PrefillChunk


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, *, scale: float) -> None:
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, Hkv, D]
        v_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
        k_slots[meta.slot_mapping] = k
        v_slots[meta.slot_mapping] = v

        out = torch.empty_like(q)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_slots, v_slots, chunk)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        max_len = meta.decode_max_seq_len
        num_blocks = -(-max_len // block_size)
        tables = meta.decode_block_tables[:, :num_blocks]  # [S, nb]
        # [S, nb, B, Hkv, D] -> [S, Hkv, L, D]
        keys = kv_cache[0][tables].view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].transpose(1, 2)
        values = kv_cache[1][tables].view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].transpose(1, 2)
        qg = q.view(num_seqs, num_kv_heads, group, head_dim)  # [S, Hkv, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale  # [S, Hkv, G, L]
        positions = torch.arange(max_len)
        pad = positions[None, :] >= meta.decode_seq_lens[:, None]  # [S, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).view(num_seqs, num_heads, head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        if chunk.context_slots is None:  # fresh: only its own tokens, plain causal
            keys, values, mask, causal = k, v, None, True
        else:
            keys, values = k_slots[chunk.context_slots], v_slots[chunk.context_slots]
            offset = chunk.context_len - chunk.query_len
            rows = torch.arange(chunk.query_len)[:, None] + offset
            mask = torch.arange(chunk.context_len)[None, :] <= rows  # [Lq, Lc], True = attend
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, Lq, D]
            keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, Lc, D]
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [Lq, H, D]
