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

@dataclass(frozen=True, kw_only=True)
class PrefillChunk:
    query_start: int  # index of its first token in the flattened step
    query_len: int
    context_len: int  # tokens it attends to, its new ones included
    context_slots: torch.Tensor | None  # [context_len] cache slots; None when fresh


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_num_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decode_tokens] int64, ascending
    prefills: tuple[PrefillChunk, ...]
    # Per prefill chunk, in order: its block table (padded with 0), for backends that read the cache through block
    # tables (Triton); None where the builder had no tables to give (the torch backends use context_slots).
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_num_blocks] int64
