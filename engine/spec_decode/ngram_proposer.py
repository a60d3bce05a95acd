"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the request's own last n tokens.

    tokens   a b c d e f a b c       suffix "a b c" (n = 3) occurred at 0..2, followed by "d e f"
    drafts   d e f ...               up to k tokens; the longest n in [min, max] that occurs wins

Pure Python over numpy, no model and no KV of its own: nothing crosses the prefill → decode handoff for it beyond
the request's token ids, which cross anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.core.request import Request


class NgramProposer:
    def __init__(self, *, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        return [
            propose_ngram(r.all_token_ids, k, min_n=self.min_n, max_n=self.max_n) if k > 0 else []
            for r, k in zip(requests, num_drafts, strict=True)
        ]

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""


def propose_ngram(token_ids: Sequence[int], num_drafts: int, *, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens following the latest earlier match of the longest suffix of length in
    [min_n, max_n]; [] when no suffix recurs."""
    num_tokens = len(token_ids)
    if num_drafts <= 0 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens - n, n]: every earlier n-gram
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n  # the latest match: the most recent context is the best guess
            return tokens[follow : follow + num_drafts].tolist()
    return []
