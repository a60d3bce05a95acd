"""The loaded probe's stage costs in the planner (deploy/planner/loaded.py) on synthetic profiles: the calibration
recovers the handoff and the TTFT outside the stages that a run was simulated with, the interpolation never
prices a stage lower at a higher rate, and `plan --one-host` applies them to layouts of the probe's kind only (and
not with --no-loaded-costs). Pure: no torch, no engine, no serve (the probe against a real serve:
tests/deploy/bench/test_bench_serve.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deploy.planner.finite_run import simulate
from deploy.planner.loaded import LoadedCost, LoadedCosts, _Fixed, calibrate, probe_layout
from deploy.planner.planner import SLO, Layout, LayoutModel, PlanOptions, Traffic, plan
from deploy.planner.profile import Loaded, LoadedPoint, Serving, load_profile
from tests.deploy.planner.synthetic import synthetic_profile

SERVING = Serving(num_requests=6, prompt_tokens=256, ttft_overhead_s=0.05, step_overhead_s=0.0,
                  gateway_cpu_per_request_s=0.005, gateway_cpu_per_token_s=0.0005)
BASE = dataclasses.replace(synthetic_profile(), serving=SERVING)
PROBE = Loaded(num_colocated=0, num_prefill=1, num_decode=1, max_num_seqs=16, transport="grpc", isl=256, osl=64,
               client="aiperf", points=())
ONE_HOST = PlanOptions(max_workers=2, one_host=True)
SLO_ = SLO(ttft_s=2.0, tpot_s=0.1)
DISAGGREGATED = Layout(num_prefill=1, num_decode=1, max_num_seqs=8, transport="grpc")
COLOCATED = Layout(num_colocated=1, max_num_seqs=16)


def measured_as_if(costs: dict[float, LoadedCost], *, num_requests: int = 40) -> Loaded:
    """The probe's points as a serve whose stages cost `costs` (rate -> cost) would measure them: the simulated
    run's stage means and TTFT mean."""
    model = LayoutModel(BASE, Traffic(isl=PROBE.isl, osl=PROBE.osl), probe_layout(PROBE),
                        dataclasses.replace(ONE_HOST, loaded_costs=False))
    points = []
    for rate, cost in costs.items():
        model.loaded = _Fixed(cost)
        run = simulate(model, rate, num_requests)
        stages = run.stages
        points.append(LoadedPoint(rate=rate, num_requests=num_requests, ttft_mean_s=run.ttft_mean_s,
                                  router_queue_s=stages["router_queue"], prefill_queue_s=stages["prefill_queue"],
                                  prefill_s=stages["prefill"], kv_transfer_s=stages["kv_transfer"],
                                  tpot_p50_s=run.tpot_p50_s, host_busy_cores=1.5))
    return dataclasses.replace(PROBE, points=tuple(points))


TRUE = {1.0: LoadedCost(rate=1.0, handoff_extra_s=0.03, overhead_s=0.08),
        2.0: LoadedCost(rate=2.0, handoff_extra_s=0.05, overhead_s=0.2)}
PROFILE = dataclasses.replace(BASE, loaded=measured_as_if(TRUE))


def test_the_calibration_recovers_the_costs_a_run_was_simulated_with() -> None:
    found = calibrate(PROFILE, ONE_HOST)
    for point, true in zip(found.points, TRUE.values()):
        assert point.rate == true.rate
        assert point.handoff_extra_s == pytest.approx(true.handoff_extra_s, abs=1e-6)
        assert point.overhead_s == pytest.approx(true.overhead_s, abs=1e-6)


def test_the_costs_between_beyond_and_below_the_points() -> None:
    costs = LoadedCosts([LoadedCost(rate=2.0, handoff_extra_s=0.02, overhead_s=0.3),
                         LoadedCost(rate=1.0, handoff_extra_s=0.03, overhead_s=0.1)])
    # the handoff measured lower at the higher rate is held at the lower rate's: never cheaper at more load
    assert costs.at(2.0).handoff_extra_s == pytest.approx(0.03)
    assert costs.at(1.5).overhead_s == pytest.approx(0.2)
    assert costs.at(0.2).overhead_s == pytest.approx(0.1) and costs.at(0.2).rate == 0.2
    assert costs.at(3.0).overhead_s == pytest.approx(0.3) and costs.at(3.0).rate == 3.0  # held
    rates = [0.1 * k for k in range(1, 50)]
    for field in ("handoff_extra_s", "overhead_s"):
        values = [getattr(costs.at(r), field) for r in rates]
        assert values == sorted(values), field
    assert LoadedCosts([LoadedCost(rate=1.0, overhead_s=0.3)]).at(5.0).overhead_s == pytest.approx(0.3)
    with pytest.raises(ValueError, match="at least one point"):
        LoadedCosts([])


def test_one_host_plans_price_the_probes_layout_kind_with_its_costs() -> None:
    traffic = Traffic(isl=256, osl=64, num_requests=40)
    bare = dataclasses.replace(PROFILE, loaded=None)
    loaded = LayoutModel(PROFILE, traffic, DISAGGREGATED, ONE_HOST)
    without = LayoutModel(bare, traffic, DISAGGREGATED, ONE_HOST)
    assert loaded.loaded is not None and without.loaded is None
    for rate in (1.0, 1.5, 2.5):
        a, b = loaded.predict(rate, SLO_), without.predict(rate, SLO_)
        assert a.ttft_p50_s > b.ttft_p50_s
        assert a.stages["kv_transfer"] > b.stages["kv_transfer"] == pytest.approx(without.handoff_s)
        if rate < 2.5:
            assert a.stages["kv_transfer"] == pytest.approx(without.handoff_s + loaded.loaded.at(rate).handoff_extra_s)
        else:  # past the pool's capacity a finite run is priced at the rate it serves, below the offered one
            assert without.handoff_s + loaded.loaded.at(1.5).handoff_extra_s <= a.stages["kv_transfer"] \
                < without.handoff_s + loaded.loaded.at(rate).handoff_extra_s
    # not the other kind, not off one host, not with --no-loaded-costs, not over another transport
    assert LayoutModel(PROFILE, traffic, COLOCATED, ONE_HOST).loaded is None
    assert LayoutModel(PROFILE, traffic, DISAGGREGATED, PlanOptions(max_workers=2)).loaded is None
    off = dataclasses.replace(ONE_HOST, loaded_costs=False)
    assert LayoutModel(PROFILE, traffic, DISAGGREGATED, off).predict(1.5, SLO_) == LayoutModel(
        bare, traffic, DISAGGREGATED, ONE_HOST).predict(1.5, SLO_)
    over_inproc = dataclasses.replace(PROFILE, handoff={**PROFILE.handoff, "inproc": PROFILE.handoff["grpc"]})
    assert LayoutModel(over_inproc, traffic, dataclasses.replace(DISAGGREGATED, transport="inproc"),
                       ONE_HOST).loaded is None


def test_the_loaded_costs_lower_a_disaggregated_layouts_highest_rate_where_ttft_binds() -> None:
    traffic = Traffic(isl=256, osl=64)
    slo = SLO(ttft_s=0.8, tpot_s=0.1)  # tight enough on TTFT that TTFT, which the loaded costs lengthen, binds
    bare = dataclasses.replace(PROFILE, loaded=None)
    with_costs = LayoutModel(PROFILE, traffic, DISAGGREGATED, ONE_HOST).max_rate(slo)
    without = LayoutModel(bare, traffic, DISAGGREGATED, ONE_HOST).max_rate(slo)
    assert with_costs is not None and without is not None
    assert with_costs.max_rate < without.max_rate

    def rates(profile) -> dict[str, float | None]:
        return {p.layout.label.split(",")[0]: p.max_rate for p in plan(profile, traffic, slo, ONE_HOST).ranked}

    loaded, unloaded = rates(PROFILE), rates(bare)
    assert loaded["1P+1D"] < unloaded["1P+1D"]
    assert loaded["colocated x1"] == unloaded["colocated x1"]  # the probe's costs are a disaggregated layout's


def test_the_probe_reads_back_and_a_damaged_one_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    PROFILE.write(path)
    assert load_profile(path).loaded == PROFILE.loaded
    data = json.loads(path.read_text())
    for damage, match in ((lambda d: d["loaded"]["points"][0].update(prefill_s=-1), r"prefill_s: expected a number"),
                          (lambda d: d["loaded"]["layout"].update(num_colocated=1), "a colocated or a disaggregated"),
                          (lambda d: d["loaded"].update(points=[]), "positive rate"),
                          (lambda d: d["loaded"]["points"][1].pop("kv_transfer_s"), "missing kv_transfer_s"),
                          (lambda d: d["loaded"]["layout"].update(transport="torch"), "did not measure \\(grpc\\)")):
        broken = json.loads(json.dumps(data))
        damage(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=match):
            load_profile(path)


def test_the_probes_default_rates_load_its_prefill_worker_to_a_quarter_and_a_half() -> None:
    from deploy.planner.load_probe import default_rates
    from deploy.planner.planner import host_share_slowdown

    prompt_s = BASE.prefill.seconds(256) * host_share_slowdown(BASE, 2, "prefill")  # one thread of two workers'
    low, high = default_rates(BASE, isl=256)
    assert low < high
    assert low * prompt_s == pytest.approx(0.25, abs=0.05 * prompt_s)  # rounded to 0.05 requests/s
    assert high * prompt_s == pytest.approx(0.5, abs=0.05 * prompt_s)


def test_plan_says_which_layouts_it_priced_with_the_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.cli import main

    path = tmp_path / "profile.json"
    PROFILE.write(path)
    flags = ["plan", "--profile", str(path), "--isl", "256", "--osl", "64", "--ttft-slo", "2", "--tpot-slo", "0.1",
             "--max-workers", "2"]
    calibrated = calibrate(PROFILE, ONE_HOST).points
    main([*flags, "--one-host"])
    out = capsys.readouterr().out
    assert "disaggregated layouts over grpc priced with the profile's loaded probe (1P+1D, seqs 16 under aiperf at " \
           "1, 2 req/s): handoff " + ", ".join(f"+{p.handoff_extra_s * 1e3:.0f}" for p in calibrated) + " ms" in out
    for extra in ([], ["--one-host", "--no-loaded-costs"]):  # off one host, or turned off: not said, not priced
        main([*flags, *extra])
        assert "loaded probe" not in capsys.readouterr().out
