"""The autoscaler's decision: a pure function of one moment's pool signals, the pools' sizes, their bounds and
SLOs, and a little remembered state (when each pool last changed, since when it has been calm). No I/O, no clock:
the caller passes `now_s`. router/autoscaler.py runs it in a loop and carries decisions out.

Per pool, each tick:

    below min / above max      → straight to the bound (a manual resize outside them is undone)
    pressure                   → one worker more, unless at max or within the up cool-down of its last change
        prefill: TTFT p90 (window) > --ttft-slo   | waiting requests per worker > max_waiting_per_worker
                 | queued prompt tokens per worker > max_queued_prompt_tokens_per_worker
        decode:  TPOT p90 (window) > --tpot-slo   | KV-cache usage (pool mean) > max_kv_cache_usage
                 | (waiting + gateway-queued requests) per worker > max_waiting_per_worker
        (a percentile counts as pressure only with min_samples requests behind it)
    calm, for a while          → one worker fewer, unless at min; "a while": calm at every tick for the down
                                 cool-down, counted from the later of the pool's last change and the start of
                                 the calm
        calm = nothing waiting, the latency percentile (if any request is in the window) under
               scale_down_slo_fraction × its SLO, and (decode) the KV usage the pool would have with one worker
               fewer under scale_down_kv_usage
    otherwise                  → hold

Why it does not flap: growth needs measured pressure and waits the up cool-down after any change (the window's
percentiles still hold samples from before the change); shrinking needs calm without a break for the whole down
cool-down (longer by default), so a load that comes and goes faster than that keeps its workers. One step at a
time: a new worker changes the signals, which the next decision sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.config_checks import AT_LEAST_ONE, AT_LEAST_ZERO, POSITIVE, Check, check_fields, checked
from router.pool_signals import QUANTILES, PoolSignals

POOLS = ("prefill", "decode")
UP, DOWN, HOLD = "up", "down", "hold"


_FRACTION = Check(lambda share: 0 < share <= 1, "must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class PoolBounds:
    min_workers: int = checked(AT_LEAST_ONE)
    max_workers: int

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers ({self.min_workers})")


@dataclass(frozen=True, kw_only=True)
class AutoscalePolicy:
    """What the autoscaler aims at and how cautiously. Frozen; `serve` builds it from its flags."""

    prefill: PoolBounds
    decode: PoolBounds
    ttft_slo_s: float = checked(POSITIVE)
    tpot_slo_s: float = checked(POSITIVE)
    # the percentile held to the SLOs: one of pool_signals.QUANTILES
    slo_quantile: float = checked(Check(lambda q: q in QUANTILES, f"must be one of {QUANTILES}"), default=0.9)
    min_samples: int = checked(AT_LEAST_ONE, default=3)  # requests in the window before a percentile counts
    max_waiting_per_worker: float = checked(POSITIVE, default=4.0)
    max_queued_prompt_tokens_per_worker: int = checked(POSITIVE, default=8192)
    max_kv_cache_usage: float = checked(_FRACTION, default=0.85)
    scale_down_slo_fraction: float = checked(_FRACTION, default=0.5)  # "well under the SLO"
    scale_down_kv_usage: float = checked(_FRACTION, default=0.5)
    scale_up_cooldown_s: float = checked(AT_LEAST_ZERO, default=30.0)
    scale_down_cooldown_s: float = checked(AT_LEAST_ZERO, default=120.0)

    def __post_init__(self) -> None:
        check_fields(self)

    def bounds(self, pool: str) -> PoolBounds:
        return {"prefill": self.prefill, "decode": self.decode}[pool]


@dataclass(frozen=True, kw_only=True)
class PoolState:
    """What the policy remembers of one pool between ticks."""

    last_change_s: float | None = None  # when the policy last resized it (None: never; growth may start at once)
    calm_since_s: float | None = None  # start of the current unbroken calm (None: not calm)


@dataclass(frozen=True, kw_only=True)
class Decision:
    pool: str
    current: int
    target: int
    reason: str  # for the log: the figures that decided it
    state: PoolState  # the pool's state for the next tick

    @property
    def direction(self) -> str:
        return UP if self.target > self.current else DOWN if self.target < self.current else HOLD


def decide(policy: AutoscalePolicy, signals: Mapping[str, PoolSignals], states: Mapping[str, PoolState],
           now_s: float) -> dict[str, Decision]:
    """One tick for every pool in POOLS that `signals` holds; a pool's size is its signals' num_workers."""
    return {pool: decide_pool(policy, pool, signals[pool], states.get(pool, PoolState()), now_s)
            for pool in POOLS if pool in signals}


def decide_pool(policy: AutoscalePolicy, pool: str, signals: PoolSignals, state: PoolState,
                now_s: float) -> Decision:
    bounds = policy.bounds(pool)
    current = signals.num_workers

    def decision(target: int, reason: str, calm_since_s: float | None) -> Decision:
        last_change_s = now_s if target != current else state.last_change_s
        return Decision(pool=pool, current=current, target=target, reason=reason,
                        state=PoolState(last_change_s=last_change_s, calm_since_s=calm_since_s))

    if current < bounds.min_workers:
        return decision(bounds.min_workers, f"{current} workers, below the minimum {bounds.min_workers}", None)
    if current > bounds.max_workers:
        return decision(bounds.max_workers, f"{current} workers, above the maximum {bounds.max_workers}", None)
    since_change_s = None if state.last_change_s is None else now_s - state.last_change_s
    pressure = _pressure(policy, pool, signals)
    if pressure:
        if current >= bounds.max_workers:
            return decision(current, f"{pressure}, but at the maximum {bounds.max_workers}", None)
        if since_change_s is not None and since_change_s < policy.scale_up_cooldown_s:
            left_s = policy.scale_up_cooldown_s - since_change_s
            return decision(current, f"{pressure}, but cooling down ({left_s:.0f} s left)", None)
        return decision(current + 1, pressure, None)
    calm = _calm(policy, pool, signals)
    if not calm:
        return decision(current, "within the SLO", None)
    calm_since_s = state.calm_since_s if state.calm_since_s is not None else now_s
    if current <= bounds.min_workers:
        return decision(current, f"{calm}, at the minimum {bounds.min_workers}", calm_since_s)
    quiet_s = now_s - max(calm_since_s, state.last_change_s if state.last_change_s is not None else calm_since_s)
    if quiet_s < policy.scale_down_cooldown_s:
        return decision(current, f"{calm} for {quiet_s:.0f} s of {policy.scale_down_cooldown_s:.0f} s",
                        calm_since_s)
    return decision(current - 1, f"{calm} for {quiet_s:.0f} s", calm_since_s)


def _pressure(policy: AutoscalePolicy, pool: str, s: PoolSignals) -> str:
    """Why the pool needs a worker more ("" when it does not)."""
    q = policy.slo_quantile
    n = max(s.num_workers, 1)
    reasons = []
    if pool == "prefill":
        if s.ttft_s is not None and s.ttft_s.num_samples >= policy.min_samples and s.ttft_s.at(q) > policy.ttft_slo_s:
            reasons.append(f"TTFT p{q * 100:g} {s.ttft_s.at(q):.3f} s > SLO {policy.ttft_slo_s:g} s")
        if s.num_requests_waiting / n > policy.max_waiting_per_worker:
            reasons.append(f"{s.num_requests_waiting} requests waiting on {n} workers")
        if s.num_queued_prompt_tokens / n > policy.max_queued_prompt_tokens_per_worker:
            reasons.append(f"{s.num_queued_prompt_tokens} prompt tokens queued on {n} workers")
    else:
        if s.tpot_s is not None and s.tpot_s.num_samples >= policy.min_samples and s.tpot_s.at(q) > policy.tpot_slo_s:
            reasons.append(f"TPOT p{q * 100:g} {s.tpot_s.at(q):.3f} s > SLO {policy.tpot_slo_s:g} s")
        if s.kv_cache_usage_mean > policy.max_kv_cache_usage:
            reasons.append(f"KV cache {s.kv_cache_usage_mean:.0%} used > {policy.max_kv_cache_usage:.0%}")
        waiting = s.num_requests_waiting + s.num_gateway_queued
        if waiting / n > policy.max_waiting_per_worker:
            reasons.append(f"{waiting} requests waiting on {n} workers")
    return "; ".join(reasons)


def _calm(policy: AutoscalePolicy, pool: str, s: PoolSignals) -> str:
    """Why the pool could do with a worker fewer ("" when it could not)."""
    q = policy.slo_quantile
    if s.num_requests_waiting or s.num_gateway_queued or s.num_queued_prompt_tokens:
        return ""
    slo_s, window, name = ((policy.ttft_slo_s, s.ttft_s, "TTFT") if pool == "prefill"
                           else (policy.tpot_slo_s, s.tpot_s, "TPOT"))
    if window is not None and window.at(q) >= policy.scale_down_slo_fraction * slo_s:
        return ""
    latency = (f"{name} p{q * 100:g} {window.at(q):.3f} s" if window is not None else f"no {name} sample")
    if pool == "decode":
        n = s.num_workers
        usage_after = s.kv_cache_usage_mean * n / (n - 1) if n > 1 else s.kv_cache_usage_mean
        if usage_after >= policy.scale_down_kv_usage:
            return ""
        return f"idle ({latency}, KV cache {s.kv_cache_usage_mean:.0%} used)"
    return f"idle ({latency})"

