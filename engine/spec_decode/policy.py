"""How many drafts each decoding request gets this step: a pure function of measured costs and acceptance.

The dynamic policy maximises expected output tokens per second of the step. With per-token acceptance rate a, a
request given k drafts outputs E(k) = 1 + a + a^2 + ... + a^k tokens (the accepted drafts, then one sampled), so
its j-th draft is worth a^j more tokens. The step costs

    T(K) = overhead + per_token * (decode tokens + K) + per_prompt_token * prompt tokens + per_draft * K
                                                                   K = drafts in the step, all requests

(`StepCosts`, measured on the running engine). Goodput E/T grows by adding a draft worth g exactly when
g * T > E * (per_token + per_draft): so drafts are handed out best first (the highest a^j), while that holds.

    light load: E/T small   -> the bar is low:  long drafts for requests that accept well
    heavy load: E/T -> 1 / per_token  -> the bar rises towards 1: k falls to 0, one request at a time

The bar moves continuously with the batch, so k falls smoothly as load rises and comes back as it drops; a request
whose drafts get rejected sinks below the bar first. The fixed policy gives every request the maximum.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """Seconds: a target step's fixed part, each decode token it computes (a draft is verified as one), each
    prompt-chunk token it computes (None: the same as a decode token), and each draft token the proposer makes."""

    overhead_s: float
    per_token_s: float
    per_draft_s: float
    per_prompt_token_s: float | None = None


def choose_fixed(num_requests: int, max_num_drafts: int) -> list[int]:
    return [max_num_drafts] * num_requests


def choose_dynamic(
    acceptance_rates: Sequence[float],
    *,
    max_num_drafts: int,
    num_base_tokens: int,
    token_budget: int,
    costs: StepCosts,
    num_prompt_tokens: int = 0,
) -> list[int]:
    """k per request (0: no speculation), in the order of `acceptance_rates`.

    num_base_tokens: the step's real tokens (one per decoding request, plus any prompt chunks);
    num_prompt_tokens: how many of those are prompt-chunk tokens;
    token_budget: the step's token budget, which drafts may not push it past.
    """
    num_drafts = [0] * len(acceptance_rates)
    room = token_budget - num_base_tokens
    if room <= 0 or max_num_drafts <= 0:
        return num_drafts
    expected_tokens = float(len(acceptance_rates))
    per_prompt_token_s = costs.per_token_s if costs.per_prompt_token_s is None else costs.per_prompt_token_s
    step_s = (costs.overhead_s + costs.per_token_s * (num_base_tokens - num_prompt_tokens)
              + per_prompt_token_s * num_prompt_tokens)
    draft_cost_s = costs.per_token_s + costs.per_draft_s
    # Max-heap of each request's next draft's worth, a^(k+1).
    heap = [(-rate, i) for i, rate in enumerate(acceptance_rates) if rate > 0.0]
    heapq.heapify(heap)
    while heap and room > 0:
        negative_worth, i = heap[0]
        worth = -negative_worth
        if worth * step_s <= expected_tokens * draft_cost_s:
            break  # the best draft left does not raise tokens per second; no later one does either
        heapq.heappop(heap)
        num_drafts[i] += 1
        expected_tokens += worth
        step_s += draft_cost_s
        room -= 1
        if num_drafts[i] < max_num_drafts:
            heapq.heappush(heap, (-worth * acceptance_rates[i], i))
    return num_drafts
