"""Measured costs for the dynamic policy: a target step's time as a line in its token count, and the proposer's
time per draft token, both fitted online on the running engine with exponential forgetting (recent steps weigh
most: the load and the machine change). No torch.

Until two steps with different token counts have been seen, a line cannot be fitted; the step time measured so
far is then split evenly between the fixed part and the tokens, a neutral guess the first measurements replace.
"""

from __future__ import annotations

from engine.spec_decode.policy import StepCosts


class StepCostModel:
    def __init__(self, *, decay: float = 0.97) -> None:
        self.decay = decay
        # Exponentially weighted sums for least squares of step time (y) on token count (x).
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._draft_s = 0.0  # weighted proposer seconds
        self._draft_n = 0.0  # weighted draft tokens

    @property
    def num_observations(self) -> float:
        return self._w

    def observe_step(self, num_tokens: int, elapsed_s: float) -> None:
        d = self.decay
        x, y = float(num_tokens), elapsed_s
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y

    def observe_draft(self, num_draft_tokens: int, elapsed_s: float) -> None:
        if num_draft_tokens <= 0:
            return
        self._draft_s = self.decay * self._draft_s + elapsed_s
        self._draft_n = self.decay * self._draft_n + num_draft_tokens

    def costs(self) -> StepCosts | None:
        """The fitted costs, or None before any target step was measured."""
        if self._w == 0.0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        variance = self._xx / self._w - mean_x * mean_x
        covariance = self._xy / self._w - mean_x * mean_y
        if variance > 1e-9 * max(1.0, mean_x * mean_x):
            per_token = max(covariance / variance, 0.0)
            overhead = max(mean_y - per_token * mean_x, 0.0)
        else:  # every step had the same token count: no slope to fit yet
            per_token = mean_y / (2.0 * max(mean_x, 1.0))
            overhead = mean_y / 2.0
        # A fit on noisy steps may give a zero slope; a token is never free.
        per_token = max(per_token, 1e-3 * mean_y / max(mean_x, 1.0))
        per_draft = self._draft_s / self._draft_n if self._draft_n > 0 else 0.0
        return StepCosts(overhead_s=overhead, per_token_s=per_token, per_draft_s=per_draft)
