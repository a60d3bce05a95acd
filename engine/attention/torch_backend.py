"""Paged attention in plain torch: the reference backend, and the CPU one.

Decode tokens (one query each) are grouped by context length; each group gathers its blocks with one
`index_select` per K and V over the flat `[num_blocks, block_size * Hkv * D]` view (a row copy, the cheapest
gather torch has) and runs one masked SDPA. Prefill chunks run one by one with SDPA: plain causal when fresh, an
offset-causal mask after cached context.

The cache is read and written through three methods (`store`, `gather_blocks`, `gather_slots`), so that a
quantized cache changes only those: an fp8 cache casts (here), an int8 one scales (`int8_kv_backend.py`). Both run
on any device: every tensor this backend makes is made on the device of the step's metadata.
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
        groups.append(_decode_group(tables[start:end], seq_lens[start:end], block_size, start,
                                    meta.slot_mapping.device))
        start = end
    return tuple(groups)


def _decode_group(
    tables: list[list[int]], seq_lens: list[int], block_size: int, first_row: int, device: torch.device
) -> DecodeGroup:
    max_len = max(seq_lens)
    width = cdiv(max_len, block_size)
    flat = [b for t in tables for b in (t[:width] + [0] * (width - len(t[:width])))]
    lens = torch.tensor(seq_lens)
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    return DecodeGroup(
        rows=slice(first_row, first_row + len(seq_lens)),
        block_ids=torch.tensor(flat).to(device),
        max_seq_len=max_len,
        mask=mask.to(device),
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
        self.store(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decode_tokens:
            out[: meta.num_decode_tokens] = self.decode(q[: meta.num_decode_tokens], kv_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, chunk)
        return out

    # -- the cache's three accessors (a quantized cache overrides them) ----------------------------------------
    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k/v [T, Hkv, D] at the token slots `slot_mapping` [T] (cast to the cache's dtype)."""
        num_tokens, num_kv_heads, head_dim = k.shape
        row = num_kv_heads * head_dim
        for which, x in ((0, k), (1, v)):
            slots = _indexable(kv_cache[which].view(-1, row))  # one row per token slot
            slots.index_copy_(0, slot_mapping, _indexable(x.reshape(num_tokens, row).to(kv_cache.dtype)))

    def gather_blocks(self, kv_cache: torch.Tensor, which: int, block_ids: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """K (which=0) or V (1) of the blocks `block_ids` [n]: [n, block_size, Hkv, D] in `dtype`."""
        num_blocks = kv_cache.shape[1]
        rows = torch.index_select(_indexable(kv_cache[which].view(num_blocks, -1)), 0, block_ids)  # a row copy
        return rows.view(kv_cache.dtype).view(-1, *kv_cache.shape[2:]).to(dtype)

    def gather_slots(self, kv_cache: torch.Tensor, which: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K or V at the token slots `slots` [n]: [n, Hkv, D] in `dtype`."""
        num_kv_heads, head_dim = kv_cache.shape[3:]
        rows = torch.index_select(_indexable(kv_cache[which].view(-1, num_kv_heads * head_dim)), 0, slots)
        return rows.view(kv_cache.dtype).view(-1, num_kv_heads, head_dim).to(dtype)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the step's decode tokens (the first `meta.num_decode_tokens` rows)."""
        out = torch.empty_like(q)
        for group in self._decode_groups(meta, kv_cache.shape[2]):
            out[group.rows] = self._decode_group(q[group.rows], kv_cache, group)
        return out

    def _decode_group(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        max_len = group.max_seq_len
        # [S * nb, B, Hkv, D] -> [S, nb * B, Hkv, D] -> [S, Hkv, L, D] (a strided view, no copy)
        keys = self.gather_blocks(kv_cache, 0, group.block_ids, q.dtype).view(num_seqs, -1, num_kv_heads, head_dim)
        values = self.gather_blocks(kv_cache, 1, group.block_ids, q.dtype).view(num_seqs, -1, num_kv_heads, head_dim)
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
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        if chunk.context_slots is None:  # fresh: only its own tokens, plain causal
            keys, values, mask, causal = k, v, None, True
        else:
            keys = self.gather_slots(kv_cache, 0, chunk.context_slots, q.dtype)
            values = self.gather_slots(kv_cache, 1, chunk.context_slots, q.dtype)
            offset = chunk.context_len - chunk.query_len
            rows = torch.arange(chunk.query_len, device=q.device)[:, None] + offset
            mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= rows  # [Lq, Lc], True = attend
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


def _indexable(rows: torch.Tensor) -> torch.Tensor:
    """`rows` as a dtype index_copy_/index_select take on every device: float8 is moved as its bytes."""
    return rows.view(torch.uint8) if rows.dtype in _FLOAT8 else rows


_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))
