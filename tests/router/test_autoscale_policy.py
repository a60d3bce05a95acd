"""The autoscaler's decision function on signal traces: a trace is one signal snapshot per tick (1 s apart unless
said), replayed with each pool's size following the decisions, as the running autoscaler would. Synthetic traces
pin each rule down; a trace recorded from a real cluster (bench/autoscale_trace.py) checks them together."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from router.autoscale_policy import (
    DOWN,
    HOLD,
    UP,
    AutoscalePolicy,
    Decision,
    PoolBounds,
    PoolState,
    decide,
    decide_pool,
)
from router.pool_signals import PoolSignals, Quantiles

POLICY = AutoscalePolicy(prefill=PoolBounds(min_workers=1, max_workers=3), decode=PoolBounds(min_workers=1,
                         max_workers=2), ttft_slo_s=1.0, tpot_slo_s=0.1, scale_up_cooldown_s=30.0,
                         scale_down_cooldown_s=120.0)


def latency(p90_s: float, num_samples: int = 10) -> Quantiles:
    return Quantiles(p50=p90_s / 2, p90=p90_s, p99=p90_s * 2, num_samples=num_samples)


# Snapshots as the gateway takes them (num_workers is filled in by the replay from the pool's current size).
IDLE = {"prefill": PoolSignals(num_workers=0), "decode": PoolSignals(num_workers=0)}
SLOW_TTFT = {**IDLE, "prefill": PoolSignals(num_workers=0, num_requests_running=4, ttft_s=latency(2.5))}
SLOW_TPOT = {**IDLE, "decode": PoolSignals(num_workers=0, num_requests_running=8, tpot_s=latency(0.3),
                                           kv_cache_usage_mean=0.4)}
STEADY = {"prefill": PoolSignals(num_workers=0, num_requests_running=2, ttft_s=latency(0.7)),
          "decode": PoolSignals(num_workers=0, num_requests_running=4, tpot_s=latency(0.07),
                                kv_cache_usage_mean=0.3)}


def replay(trace: list[dict[str, PoolSignals]], sizes: dict[str, int], *, policy: AutoscalePolicy = POLICY,
           times_s: list[float] | None = None) -> tuple[list[tuple[float, str, int, int]], dict[str, int],
                                                         list[Decision]]:
    """(the resizes as (time, pool, from, to), the final sizes, every decision). `times_s`: each tick's time
    (default: 0, 1, 2, ... s)."""
    states: dict[str, PoolState] = {}
    sizes = dict(sizes)
    resizes, decisions = [], []
    for i, snapshot in enumerate(trace):
        now_s = float(i) if times_s is None else times_s[i]
        signals = {pool: dataclasses.replace(s, num_workers=sizes[pool]) for pool, s in snapshot.items()}
        for pool, decision in decide(policy, signals, states, now_s).items():
            states[pool] = decision.state
            decisions.append(decision)
            if decision.direction != HOLD:
                resizes.append((now_s, pool, decision.current, decision.target))
                sizes[pool] = decision.target
    return resizes, sizes, decisions


def test_a_slow_ttft_grows_the_prefill_pool_one_step_per_cooldown_up_to_its_max() -> None:
    resizes, sizes, decisions = replay([SLOW_TTFT] * 100, {"prefill": 1, "decode": 1})
    assert resizes == [(0, "prefill", 1, 2), (30, "prefill", 2, 3)]
    assert sizes == {"prefill": 3, "decode": 1}
    assert decisions[0].reason == "TTFT p90 2.500 s > SLO 1 s"
    cooling = [d.reason for d in decisions[2:60:2]]  # prefill's decisions between the two resizes
    assert cooling[0] == "TTFT p90 2.500 s > SLO 1 s, but cooling down (29 s left)"
    assert decisions[-2].pool == "prefill" and decisions[-2].reason.endswith("but at the maximum 3")


def test_a_slow_tpot_grows_the_decode_pool_and_leaves_prefill_alone() -> None:
    resizes, sizes, _ = replay([SLOW_TPOT] * 100, {"prefill": 1, "decode": 1})
    assert resizes == [(0, "decode", 1, 2)]
    assert sizes == {"prefill": 1, "decode": 2}


@pytest.mark.parametrize(("pool", "signals", "reason"), [
    ("prefill", PoolSignals(num_workers=0, num_requests_waiting=9), "9 requests waiting on 2 workers"),
    ("prefill", PoolSignals(num_workers=0, num_queued_prompt_tokens=20000), "20000 prompt tokens queued on 2 workers"),
    ("decode", PoolSignals(num_workers=0, kv_cache_usage_mean=0.9), "KV cache 90% used > 85%"),
    ("decode", PoolSignals(num_workers=0, num_requests_waiting=3, num_gateway_queued=6),
     "9 requests waiting on 2 workers"),
], ids=["prefill-queue", "prefill-tokens", "decode-kv", "decode-queue"])
def test_queue_and_kv_pressure_grow_their_pool(pool: str, signals: PoolSignals, reason: str) -> None:
    policy = dataclasses.replace(POLICY, decode=PoolBounds(min_workers=1, max_workers=3))
    resizes, _, decisions = replay([{**IDLE, pool: signals}], {"prefill": 2, "decode": 2}, policy=policy)
    assert resizes == [(0, pool, 2, 3)]
    assert [d.reason for d in decisions if d.pool == pool] == [reason]


def test_a_percentile_over_too_few_requests_is_no_pressure() -> None:
    few = {**IDLE, "prefill": PoolSignals(num_workers=0, ttft_s=latency(5.0, num_samples=2))}
    resizes, _, decisions = replay([few] * 10, {"prefill": 1, "decode": 1})
    assert resizes == []
    assert decisions[0].reason == "within the SLO"  # nor is it calm: 5 s is not well under the SLO


def test_an_idle_pool_shrinks_one_step_per_down_cooldown_to_its_min() -> None:
    resizes, sizes, decisions = replay([IDLE] * 400, {"prefill": 3, "decode": 2})
    assert resizes == [(120, "prefill", 3, 2), (120, "decode", 2, 1), (240, "prefill", 2, 1)]
    assert sizes == {"prefill": 1, "decode": 1}
    assert decisions[0].reason == "idle (no TTFT sample) for 0 s of 120 s"
    assert decisions[-1].reason == "idle (no TPOT sample, KV cache 0% used), at the minimum 1"


def test_steady_load_within_the_slo_holds() -> None:
    resizes, _, decisions = replay([STEADY] * 300, {"prefill": 2, "decode": 2})
    assert resizes == []
    assert {d.reason for d in decisions} == {"within the SLO"}  # 0.7 s / 0.07 s: under the SLOs, not well under


def test_a_decode_pool_whose_kv_would_overflow_one_worker_fewer_keeps_it() -> None:
    busy_kv = {**IDLE, "decode": PoolSignals(num_workers=0, kv_cache_usage_mean=0.3)}  # 2 workers: 0.6 on one
    resizes, _, _ = replay([busy_kv] * 300, {"prefill": 1, "decode": 2})
    assert resizes == []


def test_one_busy_moment_restarts_the_calm() -> None:
    blip = {**IDLE, "prefill": PoolSignals(num_workers=0, num_requests_waiting=1)}
    trace = [IDLE] * 100 + [blip] + [IDLE] * 200
    resizes, _, _ = replay(trace, {"prefill": 2, "decode": 1})
    assert resizes == [(221, "prefill", 2, 1)]  # 120 s after the calm began again at t = 101


def test_growth_after_a_shrink_waits_the_up_cooldown() -> None:
    trace = [IDLE] * 121 + [SLOW_TTFT] * 40
    resizes, _, _ = replay(trace, {"prefill": 2, "decode": 1})
    assert resizes == [(120, "prefill", 2, 1), (150, "prefill", 1, 2)]


def test_an_oscillating_load_does_not_flap() -> None:
    """Busy 20 s, idle 40 s, for 20 minutes: the pool grows to what the bursts need and stays there."""
    trace = ([SLOW_TTFT] * 20 + [IDLE] * 40) * 20
    resizes, sizes, _ = replay(trace, {"prefill": 1, "decode": 1})
    assert resizes == [(0, "prefill", 1, 2), (60, "prefill", 2, 3)]
    assert sizes["prefill"] == 3


def test_a_slow_oscillation_follows_the_load_without_flapping() -> None:
    """Busy 60 s, idle 300 s: grows in each burst, shrinks in each lull; no two resizes of a pool closer than the
    up cool-down, and no shrink sooner than the down cool-down after the pool's last resize."""
    trace = ([SLOW_TTFT] * 60 + [IDLE] * 300) * 3
    resizes, _, _ = replay(trace, {"prefill": 1, "decode": 1})
    assert [(t, old, new) for t, _, old, new in resizes] == [
        (0, 1, 2), (30, 2, 3), (180, 3, 2), (300, 2, 1),
        (360, 1, 2), (390, 2, 3), (540, 3, 2), (660, 2, 1),
        (720, 1, 2), (750, 2, 3), (900, 3, 2), (1020, 2, 1)]
    for (t0, *_), (t1, _, old, new) in itertools.pairwise(resizes):
        assert t1 - t0 >= (POLICY.scale_down_cooldown_s if new < old else POLICY.scale_up_cooldown_s)


def test_random_traces_never_leave_the_bounds_and_move_one_step_at_a_time() -> None:
    rng = random.Random(18)
    choices = [IDLE, STEADY, SLOW_TTFT, SLOW_TPOT,
               {"prefill": PoolSignals(num_workers=0, num_requests_waiting=50),
                "decode": PoolSignals(num_workers=0, kv_cache_usage_mean=0.99)}]
    policy = dataclasses.replace(POLICY, scale_up_cooldown_s=0.0, scale_down_cooldown_s=3.0)
    trace = [rng.choice(choices) for _ in range(3000)]
    resizes, _, _ = replay(trace, {"prefill": 1, "decode": 1}, policy=policy)
    assert len(resizes) > 100  # the trace moved the pools a lot
    for _, pool, old, new in resizes:
        bounds = policy.bounds(pool)
        assert abs(new - old) == 1 and bounds.min_workers <= new <= bounds.max_workers


@pytest.mark.parametrize(("size", "target", "reason"), [(5, 3, "5 workers, above the maximum 3"),
                                                        (1, 2, "1 workers, below the minimum 2")])
def test_a_pool_resized_outside_its_bounds_goes_back_to_them_at_once(size: int, target: int, reason: str) -> None:
    policy = dataclasses.replace(POLICY, prefill=PoolBounds(min_workers=2, max_workers=3))
    decision = decide_pool(policy, "prefill", PoolSignals(num_workers=size), PoolState(last_change_s=0.0), 1.0)
    assert (decision.target, decision.direction, decision.reason) == (target, DOWN if target < size else UP, reason)
    assert decision.state.last_change_s == 1.0


@pytest.mark.parametrize("change", [{"ttft_slo_s": 0.0}, {"tpot_slo_s": -1.0}, {"slo_quantile": 0.95},
                                    {"min_samples": 0}, {"scale_up_cooldown_s": -1.0},
                                    {"max_kv_cache_usage": 1.5}, {"scale_down_slo_fraction": 0.0}])
def test_bad_policies_are_refused(change: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(change))):
        dataclasses.replace(POLICY, **change)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_workers must be at least 1"):
        PoolBounds(min_workers=0, max_workers=2)
    with pytest.raises(ValueError, match=r"max_workers \(1\) must be >= min_workers \(2\)"):
        PoolBounds(min_workers=2, max_workers=1)


def test_directions() -> None:
    state = PoolState()
    assert [Decision(pool="decode", current=2, target=t, reason="", state=state).direction for t in (3, 1, 2)] == [
        UP, DOWN, HOLD]


def load_recorded(name: str) -> tuple[list[float], list[dict[str, PoolSignals]]]:
    """A trace bench/autoscale_trace.py recorded: each tick's time and the pools' signals."""
    recorded = json.loads((Path(__file__).parent / "data" / name).read_text())

    def signals(fields: dict[str, object]) -> PoolSignals:
        latencies = {key: Quantiles(**fields[key]) if fields[key] else None  # type: ignore[arg-type]
                     for key in ("ttft_s", "tpot_s")}
        return PoolSignals(**{**fields, **latencies})  # type: ignore[arg-type]

    ticks = recorded["ticks"]
    return [t["t"] for t in ticks], [{pool: signals(f) for pool, f in t["pools"].items()} for t in ticks]


def test_a_recorded_burst_grows_the_prefill_pool_while_it_lasts_and_quiet_shrinks_it_back() -> None:
    """Recorded on the real cluster (1 prefill + 1 decode worker, 2 vCPUs): 5 s quiet, three waves of 12
    concurrent completions (TTFT p90 up to 3.5 s over a 5 s window), 20 s quiet; with a 1 s TTFT SLO, a 1 s TPOT
    SLO and cool-downs of 5 s up and 8 s down."""
    times_s, trace = load_recorded("burst_trace.json")
    policy = dataclasses.replace(POLICY, ttft_slo_s=1.0, tpot_slo_s=1.0, scale_up_cooldown_s=5.0,
                                 scale_down_cooldown_s=8.0)
    resizes, sizes, decisions = replay(trace, {"prefill": 1, "decode": 1}, policy=policy, times_s=times_s)
    assert {pool for _, pool, _, _ in resizes} == {"prefill"}  # TPOT stayed under its SLO, KV far from full
    ups = [(t, new) for t, _, old, new in resizes if new > old]
    downs = [(t, new) for t, _, old, new in resizes if new < old]
    first_queue_s = next(t for t, s in zip(times_s, trace, strict=True) if s["prefill"].num_requests_waiting)
    last_sample_s = max(t for t, s in zip(times_s, trace, strict=True) if s["prefill"].ttft_s is not None)
    assert ups[0] == (first_queue_s, 2)  # the queue is the first sign: no TTFT is measured yet
    assert ups[-1][1] == 3 and ups[-1][0] < last_sample_s  # up to the max while the burst lasts
    assert [new for _, new in downs] == [2, 1] and sizes["prefill"] == 1  # back to the min in the quiet
    assert all(t >= last_sample_s + policy.scale_down_cooldown_s for t, _ in downs)
    assert downs[1][0] - downs[0][0] >= policy.scale_down_cooldown_s
    reasons = [d.reason for d in decisions if d.pool == "prefill" and d.direction != HOLD]
    assert reasons[0].startswith("10 requests waiting on 1 workers")
    assert reasons[1].startswith("TTFT p90 3.508 s > SLO 1 s")
