"""Verifies draft tokens against the target model: exact speculative sampling for deterministic drafts.

Every proposer here is deterministic (n-gram lookup, a greedy draft model), so a draft is a point mass q = 1{x}.
Leviathan et al. (2023) then accept x with probability min(1, p(x) / q(x)) = p(x), and on a rejection draw the
recovered token from norm(max(p - q, 0)) = p with x removed; after k accepted drafts a bonus token comes from the
target's next distribution. Here that rule is carried out by coupling: each position's token y_j is drawn from the
target distribution p_j exactly as the sampler would draw it without speculation (same shaping, same generator),
and

    drafts   d0  d1  d2                  accepted: the longest prefix with y_j == d_j (here d0, d1)
    sampled  y0  y1  y2  y3     ──▶      output:   d0 d1 y2   (y2 != d2 is the recovered token; with all three
                                                              accepted, y3 is the bonus token)

P(y_j == d_j) = p_j(d_j) is the acceptance probability, and y_j given y_j != d_j is distributed as p_j without
d_j, renormalised: the recovered distribution. So the output distribution equals the non-speculative one, and
greedy rows (y_j = argmax) accept while the argmax matches. Because p_j is computed with the drafts before j as
history, penalties and min_tokens see the same history a non-speculative step would.

A seeded request draws one noise vector per position from its own generator. After verification its generator is
put back to where it would be had the step sampled only the tokens it output: the same seed gives the same
tokens whether and however far the request speculated. Logprobs are the target's, at each output position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request.logprobs import TokenLogprobs
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import MIN_TEMPERATURE, SamplingRow
from engine.structured.bitmask import TokenBitmask


@dataclass(frozen=True, kw_only=True)
class VerifyRequest:
    """One request's positions to sample: the last real token's, then one per draft (`rows[j + 1]` has
    `drafts[: j + 1]` appended to its output history)."""

    rows: list[SamplingRow]  # len(drafts) + 1
    draft_token_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    token_ids: list[int]  # the accepted drafts, then the recovered or bonus token: 1 to len(drafts) + 1 tokens
    logprobs: list[TokenLogprobs] | None  # one per token, when asked for

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def accept_drafts(sampled: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """The rule: accepted drafts (the prefix where the target's own sample agrees) and the next sampled token.

    sampled: one token per position, len(draft_token_ids) + 1."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and sampled[num_accepted] == draft_token_ids[num_accepted]:
        num_accepted += 1
    return list(sampled[: num_accepted + 1])


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(
        self, logits: torch.Tensor, requests: Sequence[VerifyRequest], token_bitmask: TokenBitmask | None = None
    ) -> list[VerifyResult]:
        """logits: [sum of len(r.rows), vocab_size], the requests' positions in order. One result per request.
        `token_bitmask`: the grammar masks of structured requests' positions (rows of `logits`)."""
        rows = [row for request in requests for row in request.rows]
        vocab_size = logits.shape[1]
        # Seeded random requests with drafts: where their generators stand before any draw of this step.
        saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        for i, request in enumerate(requests):
            first = request.rows[0]
            if request.draft_token_ids and first.generator is not None and first.params.temperature >= MIN_TEMPERATURE:
                saved[i] = (first.generator, first.generator.get_state())
        result = self.sampler.sample(logits, rows, token_bitmask)
        out: list[VerifyResult] = []
        offset = 0
        for i, request in enumerate(requests):
            num_positions = len(request.rows)
            sampled = result.token_ids[offset : offset + num_positions]
            token_ids = accept_drafts(sampled, request.draft_token_ids)
            logprobs = None
            if request.rows[0].params.logprobs is not None:
                logprobs = [lp for lp in result.logprobs[offset : offset + len(token_ids)] if lp is not None]
            if i in saved and len(token_ids) < num_positions:
                generator, state = saved[i]
                _replay_draws(generator, state, len(token_ids), vocab_size)
            out.append(VerifyResult(token_ids=token_ids, logprobs=logprobs))
            offset += num_positions
        return out


def _replay_draws(generator: torch.Generator, state: torch.Tensor, num_draws: int, vocab_size: int) -> None:
    """Put `generator` where `num_draws` sampler draws (one noise vector of `vocab_size` each) leave it from
    `state`: the draws for positions after a rejection are taken back."""
    generator.set_state(state)
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_draws):
        scratch.uniform_(generator=generator)
