"""What an attention backend needs to know about one flattened step.

The runner lays the step's tokens out decode-first, decodes sorted by context length:

    tokens:  [ d0 d1 ... d(D-1) | p0 p0 p0 p0 | p1 p1 | ... ]
               one token each      prefill chunks (query_len > 1), contiguous per request

`slot_mapping[t]` is where token t's K/V go in the paged cache: block_table[pos // B] * B + pos % B.
A prefill chunk whose request has no earlier context ("fresh") attends only to its own new K/V, so a backend
can skip reading the cache for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A decode group starts anew when padding to the group's longest context would waste more than this fraction of
# the gathered rows: fewer groups mean fewer calls, tighter ones fewer bytes copied.
MAX_DECODE_PADDING_WASTE = 0.25


@dataclass(frozen=True, kw_only=True)
class PrefillChunk:
    query_start: int  # index of its first token in the flattened step
    query_len: int
    context_len: int  # tokens it attends to, its new ones included
    context_slots: torch.Tensor | None  # [context_len] cache slots; None when fresh


@dataclass(frozen=True, kw_only=True)
class DecodeGroup:
    """Consecutive decode tokens of similar context length, attended in one call."""

    rows: slice  # their tokens in the flattened step
    block_ids: torch.Tensor  # [num_seqs * max_num_blocks] int64: block tables, padded, flattened
    max_seq_len: int
    mask: torch.Tensor  # [num_seqs, 1, 1, max_seq_len] bool, True = a real context position


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_num_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decode_tokens] int64, ascending
    prefills: tuple[PrefillChunk, ...]


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
    width = -(-max_len // block_size)
    flat = [b for t in tables for b in (t[:width] + [0] * (width - len(t[:width])))]
    lens = torch.tensor(seq_lens)
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    return DecodeGroup(
        rows=slice(first_row, first_row + len(seq_lens)),
        block_ids=torch.tensor(flat),
        max_seq_len=max_len,
        mask=mask,
    )
