"""Paged attention in plain torch: the reference backend, and the CPU one.

Decode tokens (one query each) are grouped by context length; each group gathers its blocks with one
`index_select` per K and V over the flat `[num_blocks, block_size * Hkv * D]` view (a row copy, the cheapest
gather torch has) and runs one masked SDPA. Prefill chunks run one by one with SDPA: plain causal when fresh, an
offset-causal mask after cached context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata, PrefillChunk
from kv_transfer.layout import cdiv

# A decode group starts anew when padding to the group's longest context would waste more than this fraction of
# the gathered rows: fewer groups mean fewer calls, tighter ones fewer bytes copied.
MAX_DECODE_PADDING_WASTE = 0.25


@dataclass(frozen=True, kw_only=True)
class DecodeGroup:
    """Consecutive decode tokens of similar context length, attended in one call."""

    rows: slice  # their tokens in the flattened step
    block_ids: torch.Tensor  # [num_seqs * max_num_blocks] int64: block tables, padded, flattened
    max_seq_len: int
    mask: torch.Tensor  # [num_seqs, 1, 1, max_seq_len] bool, True = a real context position


def build_decode_groups(meta: AttentionMetadata, block_size: int) -> tuple[DecodeGroup, ...]:
    """Split the step's decode sequences (ascending length) into groups of bounded padding waste."""
    seq_lens: list[int] = meta.decode_seq_lens.tolist()
    tables: list[list[int]] = meta.decode_block_tables.tolist()
    groups: list[DecodeGroup] = []
    start = 0
    while start < len(seq_lens):
        end = start + 1
        total = seq_lens[start]
        while end < len(seq_lens):
            longest = seq_lens[end]
            if (total + longest) < (1 - MAX_DECODE_PADDING_WASTE) * longest * (end - start + 1):
                break
            total += longest
            end += 1
        groups.append(_decode_group(tables[start:end], seq_lens[start:end], block_size, start))
        start = end
    return tuple(groups)


def _decode_group(tables: list[list[int]], seq_lens: list[int], block_size: int, first_row: int) -> DecodeGroup:
    max_len = max(seq_lens)
    width = cdiv(max_len, block_size)
    flat = [b for t in tables for b in (t[:width] + [0] * (width - len(t[:width])))]
    lens = torch.tensor(seq_lens)
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    return DecodeGroup(
        rows=slice(first_row, first_row + len(seq_lens)),
        block_ids=torch.tensor(flat),
        max_seq_len=max_len,
        mask=mask,
    )


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, *, scale: float) -> None:
        self.scale = scale
        self._groups: tuple[AttentionMetadata | None, tuple[DecodeGroup, ...]] = (None, ())

    def _decode_groups(self, meta: AttentionMetadata, block_size: int) -> tuple[DecodeGroup, ...]:
        # Built once per step (the first layer), reused by the other layers.
        if self._groups[0] is not meta:
            self._groups = (meta, build_decode_groups(meta, block_size))
        return self._groups[1]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, num_kv_heads, head_dim = k.shape
        row = num_kv_heads * head_dim
        # Flat views over the paged cache: one row per token slot, and one row per block.
        k_slots, v_slots = kv_cache[0].view(-1, row), kv_cache[1].view(-1, row)
        k_slots.index_copy_(0, meta.slot_mapping, k.reshape(num_tokens, row))
        v_slots.index_copy_(0, meta.slot_mapping, v.reshape(num_tokens, row))

        out = torch.empty_like(q)
        if meta.num_decode_tokens:
            out[: meta.num_decode_tokens] = self.decode(q[: meta.num_decode_tokens], kv_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_slots, v_slots, chunk)
        return out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the step's decode tokens (the first `meta.num_decode_tokens` rows)."""
        out = torch.empty_like(q)
        for group in self._decode_groups(meta, kv_cache.shape[2]):
            out[group.rows] = self._decode_group(q[group.rows], kv_cache, group)
        return out

    def _decode_group(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_blocks, num_kv_heads = kv_cache.shape[1], kv_cache.shape[3]
        k_blocks = kv_cache[0].view(num_blocks, -1)  # [num_blocks, block_size * Hkv * D]
        v_blocks = kv_cache[1].view(num_blocks, -1)
        max_len = group.max_seq_len
        # [S * nb, B * Hkv * D] -> [S, nb * B, Hkv, D] -> [S, Hkv, L, D] (a strided view, no copy)
        keys = torch.index_select(k_blocks, 0, group.block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
        values = torch.index_select(v_blocks, 0, group.block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
        keys = keys[:, :max_len].transpose(1, 2)
        values = values[:, :max_len].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [S, H, 1, D]
            keys,
            values,
            attn_mask=group.mask,  # [S, 1, 1, L], True = attend
            scale=self.scale,
            enable_gqa=True,
        )
        return out.view(num_seqs, num_heads, head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        if chunk.context_slots is None:  # fresh: only its own tokens, plain causal
            keys, values, mask, causal = k, v, None, True
        else:
            keys = torch.index_select(k_slots, 0, chunk.context_slots).view(-1, num_kv_heads, head_dim)
            values = torch.index_select(v_slots, 0, chunk.context_slots).view(-1, num_kv_heads, head_dim)
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
