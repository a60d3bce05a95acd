"""Measured costs for the dynamic policy, fitted online on the running engine with exponential forgetting (recent
steps weigh most: the load and the machine change). No torch.

A draft token is verified as one more decode token, so what the policy needs is the marginal cost of a token
*where decode runs*. Prompt chunks cost a different amount per token (on a CPU a token of a 2048-token chunk is
cheaper than one more row of a 64-request decode step), so one line over all steps would mix the two and
underprice drafts under load. The model keeps them apart:

    decode-only steps   time = overhead + per_token * decode tokens        (a line, least squares)
    steps with prompts  time - that line's prediction  = per_prompt_token * prompt tokens  (a ratio)

Until two decode-only steps with different token counts have been seen, the decode line cannot be fitted; the
line over every step stands in, and before that the time measured so far is split evenly between the fixed part
and the tokens, a neutral guess the first measurements replace.
"""

from __future__ import annotations

from engine.spec_decode.policy import StepCosts


class _WeightedLine:
    """Least squares of y on x over exponentially weighted observations."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y

    @property
    def has_slope(self) -> bool:
        mean_x = self._x / self.w if self.w else 0.0
        return self.w > 0.0 and self._xx / self.w - mean_x * mean_x > 1e-9 * max(1.0, mean_x * mean_x)

    def fit(self) -> tuple[float, float]:
        """(intercept, slope), both ≥ 0; needs one observation at least."""
        mean_x, mean_y = self._x / self.w, self._y / self.w
        if self.has_slope:
            variance = self._xx / self.w - mean_x * mean_x
            slope = max((self._xy / self.w - mean_x * mean_y) / variance, 0.0)
            intercept = max(mean_y - slope * mean_x, 0.0)
        else:  # every step had the same token count: no slope to fit yet
            slope = mean_y / (2.0 * max(mean_x, 1.0))
            intercept = mean_y / 2.0
        # A fit on noisy steps may give a zero slope; a token is never free.
        return intercept, max(slope, 1e-3 * mean_y / max(mean_x, 1.0))


class StepCostModel:
    def __init__(self, *, decay: float = 0.97) -> None:
        self.decay = decay
        self._decode = _WeightedLine(decay)  # decode-only steps
        self._every = _WeightedLine(decay)  # every step, prompt tokens counted as decode tokens: the stand-in
        self._prompt_s = 0.0  # weighted seconds of steps with prompt chunks beyond the decode line's prediction
        self._prompt_n = 0.0  # weighted prompt tokens of those steps
        self._draft_s = 0.0  # weighted proposer seconds
        self._draft_n = 0.0  # weighted draft tokens

    @property
    def num_observations(self) -> float:
        return self._every.w

    def observe_step(self, num_tokens: int, elapsed_s: float, *, num_prompt_tokens: int = 0) -> None:
        """A target step of `num_tokens` tokens, `num_prompt_tokens` of them prompt-chunk tokens (the rest are
        decode tokens and drafts), took `elapsed_s`."""
        self._every.observe(float(num_tokens), elapsed_s)
        num_decode_tokens = num_tokens - num_prompt_tokens
        if num_prompt_tokens <= 0:
            self._decode.observe(float(num_decode_tokens), elapsed_s)
            return
        if self._decode.has_slope:
            overhead, per_token = self._decode.fit()
            residual_s = max(elapsed_s - overhead - per_token * num_decode_tokens, 0.0)
            self._prompt_s = self.decay * self._prompt_s + residual_s
            self._prompt_n = self.decay * self._prompt_n + num_prompt_tokens

    def observe_draft(self, num_draft_tokens: int, elapsed_s: float) -> None:
        if num_draft_tokens <= 0:
            return
        self._draft_s = self.decay * self._draft_s + elapsed_s
        self._draft_n = self.decay * self._draft_n + num_draft_tokens

    def costs(self) -> StepCosts | None:
        """The fitted costs, or None before any target step was measured."""
        if self._every.w == 0.0:
            return None
        overhead, per_token = (self._decode if self._decode.has_slope else self._every).fit()
        per_prompt_token = self._prompt_s / self._prompt_n if self._prompt_n > 0 else per_token
        per_draft = self._draft_s / self._draft_n if self._draft_n > 0 else 0.0
        return StepCosts(overhead_s=overhead, per_token_s=per_token, per_draft_s=per_draft,
                         per_prompt_token_s=per_prompt_token)
