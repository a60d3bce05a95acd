"""The finite-run model (deploy/planner/finite_run.py) on synthetic profiles: a lone request's exact costs, the
gateway's admission rule counted exactly, agreement with the steady-state model below capacity, and a saturated
run's backlog growing with its length and its rate. Pure: no torch, no engine; each test well under a second."""

from __future__ import annotations

import math

import pytest

from deploy.planner.finite_run import percentile, simulate
from deploy.planner.planner import SLO, Layout, LayoutModel, PlanOptions, Traffic, plan
from tests.deploy.planner.synthetic import GRPC, synthetic_profile

PROFILE = synthetic_profile()
SLO_ = SLO(ttft_s=2.0, tpot_s=0.15)
COLOCATED = Layout(num_colocated=1, max_num_seqs=16)
DISAGGREGATED = Layout(num_prefill=1, num_decode=1, max_num_seqs=16, transport="grpc")


def model(layout: Layout, num_requests: int | None = None, isl: int = 1024, osl: int = 256) -> LayoutModel:
    return LayoutModel(PROFILE, Traffic(isl=isl, osl=osl, num_requests=num_requests), layout, PlanOptions())


def capacity(layout: Layout) -> float:
    """The highest rate at which the steady-state model is stable (bisection)."""
    steady, low, high = model(layout), 0.01, 100.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if steady.predict(mid, SLO_).stable else (low, mid)
    return low


def test_a_lone_request_costs_one_prefill_and_one_step_a_token() -> None:
    # Requests an hour apart: each alone on the worker. Colocated: its prefill is one step (1,024 tokens within the
    # budget of 2,048), its first token at that step's end, then one 1-sequence step a token.
    m = model(COLOCATED, num_requests=3)
    run = simulate(m, 1 / 3600, 3, num_runs=2)
    assert run.ttft_p50_s == pytest.approx(PROFILE.prefill.seconds(1024), rel=1e-9)
    assert run.tpot_p50_s == pytest.approx(PROFILE.decode.seconds(1, 1024 + 128), rel=1e-9)
    assert run.num_refused == 0
    # Disaggregated: the prefill, the KV handoff of 64 blocks, then the decode worker's steps.
    m = model(DISAGGREGATED, num_requests=3)
    run = simulate(m, 1 / 3600, 3, num_runs=2)
    assert run.ttft_p50_s == pytest.approx(PROFILE.prefill.seconds(1024) + GRPC.seconds(64 * 737_280), rel=1e-9)
    assert run.tpot_p50_s == pytest.approx(PROFILE.decode.seconds(1, 1024 + 128), rel=1e-9)
    # its TTFT stages as the gateway's histograms time them: no queue, the prefill, the handoff
    assert run.stages == pytest.approx({"router_queue": 0.0, "prefill_queue": 0.0,
                                        "prefill": PROFILE.prefill.seconds(1024),
                                        "kv_transfer": GRPC.seconds(64 * 737_280)}, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("layout, num_requests, refused", [
    (COLOCATED, 40, 40 - 16 - 16), (DISAGGREGATED, 40, 40 - 16 - 16),
    (Layout(num_prefill=1, num_decode=1, max_num_seqs=8, transport="grpc"), 40, 40 - 8 - 8),
    (Layout(num_colocated=2, max_num_seqs=8), 40, 40 - 16 - 16), (COLOCATED, 30, 0)])
def test_the_gateway_runs_its_slots_queues_as_many_and_refuses_the_rest(layout: Layout, num_requests: int,
                                                                        refused: int) -> None:
    # Every request at once: the pool's slots (sum of --max-num-seqs) run, as many wait, the rest get 429
    # (router/admission.py: may_queue with max_queued_requests None). Short requests: none waits out the queue's
    # 30 s timeout.
    run = simulate(model(layout, num_requests, isl=256, osl=16), 1e6, num_requests)
    assert run.num_refused == refused
    assert math.isfinite(run.ttft_p90_s)
    # the queued half waited at the gateway, the running half at the workers: both stages have time in them
    assert run.stages["router_queue"] > 0 and run.stages["prefill_queue"] > 0


def test_a_request_queued_past_the_timeout_is_refused_too() -> None:
    # 1,024 + 256 tokens a request hold a slot for over 8 s: of 16 queued behind 16 running, those whose turn comes
    # after 30 s leave the queue with a 503, which AIPerf counts among the errors as it does a 429.
    run = simulate(model(COLOCATED, 40), 1e6, 40)
    assert run.num_refused > 40 - 16 - 16
    assert run.ttft_p90_s < 30 + 8 * 2


@pytest.mark.parametrize("layout", [COLOCATED, DISAGGREGATED], ids=["colocated", "disaggregated"])
def test_below_capacity_a_long_run_agrees_with_the_steady_state_model(layout: Layout) -> None:
    cap = capacity(layout)
    steady, finite = model(layout), model(layout, num_requests=200)
    for fraction in (0.2, 0.4, 0.6):
        s, f = steady.predict(fraction * cap, SLO_), finite.predict(fraction * cap, SLO_)
        assert s.stable and f.num_refused == 0
        assert f.ttft_p50_s == pytest.approx(s.ttft_p50_s, rel=0.15), fraction
        assert f.tpot_p50_s == pytest.approx(s.tpot_p50_s, rel=0.15), fraction


@pytest.mark.parametrize("layout", [COLOCATED, DISAGGREGATED], ids=["colocated", "disaggregated"])
def test_past_capacity_a_finite_run_has_a_finite_backlog_that_grows_with_its_length_and_rate(layout: Layout) -> None:
    cap = capacity(layout)
    assert not model(layout).predict(1.2 * cap, SLO_).stable  # steady state: no answer
    by_length = [model(layout, n).predict(1.5 * cap, SLO_) for n in (10, 20, 40, 80, 160)]
    assert all(math.isfinite(p.ttft_p90_s) and math.isfinite(p.tpot_p90_s) for p in by_length)
    ttft = [p.ttft_p50_s for p in by_length]
    assert ttft == sorted(ttft) and ttft[-1] > 3 * ttft[0], ttft
    by_rate = [model(layout, 40).predict(f * cap, SLO_) for f in (0.2, 0.5, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0)]
    for metric in ("ttft_p50_s", "ttft_p90_s"):
        values = [getattr(p, metric) for p in by_rate]
        assert values == sorted(values), (metric, values)
    # TPOT grows to the full batch's step and stays there: past it, which requests a run completes moves it a little.
    tpot = [p.tpot_p50_s for p in by_rate]
    assert tpot[:5] == sorted(tpot[:5]) and max(tpot[4:]) < 1.1 * min(tpot[4:]), tpot
    refused = [p.num_refused for p in by_rate]
    assert refused[:4] == [0, 0, 0, 0] and refused == sorted(refused) and refused[-1] >= 1, refused
    assert by_rate[-1].binding == "admission" and not by_rate[-1].meets


def test_a_finite_plan_prices_each_layout_at_its_run_length() -> None:
    traffic = Traffic(isl=1024, osl=256, num_requests=40)
    result = plan(PROFILE, traffic, SLO_, PlanOptions(max_workers=3))
    assert result.met
    for prediction in result.ranked[:4]:
        assert prediction.num_requests == 40 and prediction.max_rate is not None
        m = LayoutModel(PROFILE, traffic, prediction.layout, PlanOptions(max_workers=3))
        assert m.predict(prediction.max_rate, SLO_).meets
        assert not m.predict(prediction.max_rate * 1.05, SLO_).meets
    # More traffic never needs fewer workers, a finite run as in steady state.
    counts = [plan(PROFILE, Traffic(isl=1024, osl=256, rate=r, num_requests=40), SLO_,
                   PlanOptions(max_workers=4)).best.layout.num_workers for r in (0.25, 0.5, 1.0, 2.0)]
    assert counts == sorted(counts) and counts[-1] > counts[0], counts
    with pytest.raises(ValueError, match="--num-requests must be at least 1"):
        Traffic(isl=10, osl=10, num_requests=0)


def test_percentiles_interpolate_as_numpy_does() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([], 50) == math.inf
