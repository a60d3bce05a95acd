"""The logprobs of one sampled token, as handed back to callers. No torch: outputs and the router use it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token, from the raw logits (before penalties, temperature and filters)."""

    token_id: int  # the sampled token
    logprob: float  # its logprob
    rank: int  # 1-based: how many tokens have a logprob >= its own (vLLM's count, so ties rank it lower)
    top: list[tuple[int, float]]  # the params.logprobs most likely (token id, logprob), descending
