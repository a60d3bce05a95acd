"""Queueing approximations the planner prices a pool with. Pure functions, no I/O.

A pool of c identical servers, Poisson arrivals at rate lam, service time s with squared coefficient of
variation cs2 (0: deterministic, as one prompt length's prefill is):

    offered load a = lam * s, utilisation rho = a / c (stable only below 1)
    P(wait)      = Erlang C(c, a)                                      (exact for M/M/c)
    mean wait    = Erlang C / (c / s - lam) * (1 + cs2) / 2            (Allen-Cunneen's M/G/c correction)
    P(W > t)     = Erlang C * exp(-theta * t), theta set so that the mean matches: a tail of the M/M/c shape

The tail is exact for M/M/c and a fair approximation for M/D/c at moderate load; quantiles come from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def erlang_c(num_servers: int, offered_load: float) -> float:
    """The probability that an arrival waits in M/M/c with c = num_servers and a = offered_load (< c)."""
    if offered_load <= 0:
        return 0.0
    if offered_load >= num_servers:
        return 1.0
    # Erlang B by its recursion (stable for large c), then C from B.
    b = 1.0
    for k in range(1, num_servers + 1):
        b = offered_load * b / (k + offered_load * b)
    rho = offered_load / num_servers
    return b / (1 - rho + rho * b)


@dataclass(frozen=True)
class Wait:
    """A waiting-time distribution: P(W > t) = p_wait * exp(-rate * t); `stable` False: it grows without bound."""

    p_wait: float
    rate: float  # 1/s
    stable: bool = True

    @property
    def mean_s(self) -> float:
        if not self.stable:
            return math.inf
        return 0.0 if self.p_wait == 0 else self.p_wait / self.rate

    def quantile(self, q: float) -> float:
        """The q-quantile of the wait (0 when at least q of arrivals do not wait)."""
        if not self.stable:
            return math.inf
        if self.p_wait <= 1 - q:
            return 0.0
        return math.log(self.p_wait / (1 - q)) / self.rate

    def p_longer(self, t: float) -> float:
        """P(W > t)."""
        if not self.stable:
            return 1.0
        if t < 0:
            return 1.0
        return self.p_wait * math.exp(-self.rate * t)


NO_WAIT = Wait(0.0, 1.0)
UNSTABLE = Wait(1.0, 0.0, stable=False)


def mgc_wait(num_servers: int, arrival_rate: float, service_s: float, cs2: float = 0.0) -> Wait:
    """The queueing delay of M/G/c (see the module docstring)."""
    if arrival_rate <= 0 or service_s <= 0:
        return NO_WAIT
    offered = arrival_rate * service_s
    if offered >= num_servers:
        return UNSTABLE
    p_wait = erlang_c(num_servers, offered)
    mean = p_wait / (num_servers / service_s - arrival_rate) * (1 + cs2) / 2
    if mean <= 0:
        return NO_WAIT
    return Wait(p_wait, p_wait / mean)


def poisson_quantile(mean: float, q: float = 0.9) -> float:
    """A normal approximation of a Poisson count's q-quantile (0.9: +1.28 standard deviations)."""
    z = {0.5: 0.0, 0.9: 1.2816, 0.99: 2.3263}.get(q, 1.2816)
    return mean + z * math.sqrt(max(mean, 0.0))
