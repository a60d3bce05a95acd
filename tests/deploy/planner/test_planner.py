"""The planner on synthetic profiles (tests/deploy/planner/synthetic.py): monotonicity in the traffic and the SLO,
the highest sustainable rate, unmeetable SLOs, bad input. Pure: no torch, no engine."""

from __future__ import annotations

import dataclasses
import math

import pytest

from deploy.planner.planner import SLO, LayoutModel, Plan, PlanOptions, Traffic, layouts, plan
from tests.deploy.planner.synthetic import synthetic_profile, without_handoff

PROFILE = synthetic_profile()
SLO_ = SLO(ttft_s=2.0, tpot_s=0.15)
OPTIONS = PlanOptions(max_workers=10)


def best_disaggregated(result: Plan):
    return next(p for p in result.ranked if p.meets and not p.layout.colocated)


def best(result: Plan):
    assert result.met, result.problem
    return result.best


@pytest.mark.parametrize("rate", [1.0, 3.0])
def test_longer_prompts_never_need_fewer_prefill_workers(rate: float) -> None:
    counts = [best_disaggregated(plan(PROFILE, Traffic(isl=isl, osl=128, rate=rate), SLO_, OPTIONS)).layout.num_prefill
              for isl in (128, 256, 512, 1024, 1536, 2048)]
    assert counts == sorted(counts), counts
    assert counts[-1] > counts[0]  # the sweep spans a change, or it shows nothing


@pytest.mark.parametrize("rate, osls", [(1.0, (16, 64, 128, 256, 512, 1024, 2048)), (3.0, (16, 64, 128, 256, 512))])
def test_longer_outputs_never_need_fewer_decode_workers(rate: float, osls: tuple[int, ...]) -> None:
    counts = [best_disaggregated(plan(PROFILE, Traffic(isl=512, osl=osl, rate=rate), SLO_, OPTIONS)).layout.num_decode
              for osl in osls]
    assert counts == sorted(counts), counts
    assert counts[-1] > counts[0]


def test_a_tighter_slo_never_needs_fewer_workers() -> None:
    traffic = Traffic(isl=1024, osl=256, rate=2.5)
    by_ttft = [best(plan(PROFILE, traffic, SLO(ttft_s=t, tpot_s=0.15), OPTIONS)).layout.num_workers
               for t in (4.0, 2.0, 1.0, 0.7, 0.62)]
    assert by_ttft == sorted(by_ttft), by_ttft
    by_tpot = [best(plan(PROFILE, traffic, SLO(ttft_s=2.0, tpot_s=t), OPTIONS)).layout.num_workers
               for t in (0.5, 0.2, 0.15, 0.1, 0.08, 0.06)]
    assert by_tpot == sorted(by_tpot), by_tpot
    assert by_ttft[-1] > by_ttft[0] and by_tpot[-1] > by_tpot[0]


def test_more_traffic_never_needs_fewer_workers() -> None:
    counts = [best(plan(PROFILE, Traffic(isl=1024, osl=256, rate=r), SLO_, OPTIONS)).layout.num_workers
              for r in (0.25, 0.5, 1.0, 2.0, 3.0, 4.0)]
    assert counts == sorted(counts) and counts[-1] > counts[0], counts


def test_predictions_grow_with_the_rate_and_the_pools_saturate() -> None:
    (layout,) = [l for l in layouts(PROFILE, Traffic(isl=1024, osl=256), OPTIONS)
                 if l.num_prefill == 1 and l.num_decode == 1 and l.max_num_seqs == 32]
    model = LayoutModel(PROFILE, Traffic(isl=1024, osl=256), layout, OPTIONS)
    predictions = [model.predict(r, SLO_) for r in (0.1, 0.5, 1.0, 1.2)]
    assert all(p.stable for p in predictions)
    for metric in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s"):
        values = [getattr(p, metric) for p in predictions]
        assert values == sorted(values), (metric, values)
    # One prefill worker prefills a 1,024-token prompt in 0.01 + 0.512 + 0.052 = 0.574 s: past 1.74 req/s it
    # cannot keep up.
    assert PROFILE.prefill.seconds(1024) == pytest.approx(0.5744, abs=1e-4)
    saturated = model.predict(1.0 / 0.5744 * 1.01, SLO_)
    assert not saturated.stable and saturated.binding == "prefill capacity"
    assert all(p.ttft_p50_s >= PROFILE.prefill.seconds(1024) for p in predictions)


def test_without_a_rate_each_layout_gets_its_highest_rate_within_the_slo() -> None:
    traffic = Traffic(isl=1024, osl=256)
    result = plan(PROFILE, traffic, SLO_, PlanOptions(max_workers=4))
    assert result.met
    for prediction in result.ranked[:5]:
        assert prediction.max_rate is not None and prediction.meets
        model = LayoutModel(PROFILE, traffic, prediction.layout, PlanOptions(max_workers=4))
        assert model.predict(prediction.max_rate, SLO_).meets
        assert not model.predict(prediction.max_rate * 1.02, SLO_).meets
    per_worker = [p.max_rate / p.layout.num_workers for p in result.ranked if p.max_rate is not None]
    assert per_worker == sorted(per_worker, reverse=True)


def test_an_unmeetable_slo_names_the_closest_layout_and_what_binds() -> None:
    result = plan(PROFILE, Traffic(isl=1024, osl=256, rate=20.0), SLO_, PlanOptions(max_workers=4))
    assert not result.met
    assert "no layout within 4 workers meets the SLO at 20.0 requests/s" in result.problem
    assert result.best.layout.label in result.problem and "binding: " in result.problem
    # A TPOT just above one sequence's step: only a lone sequence meets it, which no layout of 4 holds at 2 req/s.
    tight = plan(PROFILE, Traffic(isl=1024, osl=256, rate=2.0), SLO(ttft_s=10.0, tpot_s=0.0232),
                 PlanOptions(max_workers=4))
    assert not tight.met and tight.best.binding in ("tpot", "decode capacity"), tight.problem


def test_colocated_and_disaggregated_are_both_priced() -> None:
    result = plan(PROFILE, Traffic(isl=1024, osl=256, rate=1.0), SLO_, OPTIONS)
    kinds = {p.layout.colocated for p in result.ranked}
    assert kinds == {True, False}
    # A prefix hit shortens every prefill: a prompt with 75% cached prefills in less than a quarter of the time.
    hit = plan(PROFILE, Traffic(isl=1024, osl=256, rate=1.0, prefix_hit=0.75), SLO_, OPTIONS)
    assert best(hit).ttft_p50_s < best(result).ttft_p50_s
    # No handoff measured: only colocated layouts.
    colocated_only = plan(without_handoff(PROFILE), Traffic(isl=1024, osl=256, rate=1.0), SLO_, OPTIONS)
    assert all(p.layout.colocated for p in colocated_only.ranked)


def test_one_host_shares_the_cores() -> None:
    traffic = Traffic(isl=1024, osl=256, rate=0.5)
    (layout,) = [l for l in layouts(PROFILE, traffic, OPTIONS)
                 if l.num_prefill == 1 and l.num_decode == 1 and l.max_num_seqs == 32]
    apart = LayoutModel(PROFILE, traffic, layout, PlanOptions()).predict(0.5, SLO_)
    shared = LayoutModel(PROFILE, traffic, layout, PlanOptions(one_host=True)).predict(0.5, SLO_)
    # two workers on the 2 profiled cores: one thread each, where the profile had two: every compute time doubles
    assert shared.tpot_p50_s > 1.9 * apart.tpot_p50_s
    assert shared.ttft_p50_s > apart.ttft_p50_s + PROFILE.prefill.seconds(1024) * 0.9


def test_sharing_the_host_scales_by_the_measured_one_thread_cost() -> None:
    from deploy.planner.planner import host_share_slowdown

    measured = dataclasses.replace(PROFILE, one_thread={"prefill": 1.9, "decode": 1.4})  # 2 cores, 2 threads
    assert [host_share_slowdown(measured, n, "prefill") for n in (1, 2, 4)] == [1.0, 1.9, pytest.approx(3.8)]
    assert host_share_slowdown(measured, 2, "decode") == 1.4
    assert host_share_slowdown(PROFILE, 2, "decode") == 2.0  # not measured: linear
    big = dataclasses.replace(measured, machine={"cpu_count": 8, "num_threads": 8})
    # 2 workers of 4 threads: a third of the way (in log threads) from 8 threads to 1
    assert host_share_slowdown(big, 2, "prefill") == pytest.approx(1.9 ** (1 / 3))
    assert host_share_slowdown(big, 1, "prefill") == 1.0


@pytest.mark.parametrize("traffic, slo, match", [
    (dict(isl=1024, osl=256, rate=-1.0), dict(ttft_s=2, tpot_s=0.15), "--rate must be positive"),
    (dict(isl=1024, osl=256, rate=0.0), dict(ttft_s=2, tpot_s=0.15), "--rate must be positive"),
    (dict(isl=0, osl=256), dict(ttft_s=2, tpot_s=0.15), "--isl and --osl must be at least 1"),
    (dict(isl=1024, osl=256, prefix_hit=1.0), dict(ttft_s=2, tpot_s=0.15), "--prefix-hit must be in"),
    (dict(isl=1024, osl=256), dict(ttft_s=0, tpot_s=0.15), "must be positive"),
])
def test_bad_traffic_or_slo_is_a_clear_error(traffic: dict, slo: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(PROFILE, Traffic(**traffic), SLO(**slo), OPTIONS)


def test_an_slo_below_the_profiles_floor_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"--ttft-slo 0.5 s is below the profile's floor: a lone 1024-token prompt "
                                         r"\(0 cached\) takes 0.574 s"):
        plan(PROFILE, Traffic(isl=1024, osl=256, rate=1.0), SLO(ttft_s=0.5, tpot_s=0.15), OPTIONS)
    with pytest.raises(ValueError, match=r"--tpot-slo 0.02 s is below the profile's floor"):
        plan(PROFILE, Traffic(isl=1024, osl=256, rate=1.0), SLO(ttft_s=2, tpot_s=0.02), OPTIONS)
    with pytest.raises(ValueError, match="exceeds the profiled max_model_len 8192"):
        plan(PROFILE, Traffic(isl=8000, osl=256, rate=1.0), SLO(ttft_s=20, tpot_s=0.15), OPTIONS)
    with pytest.raises(ValueError, match="needs 17 KV blocks; the profiled worker holds 16"):
        plan(synthetic_profile(num_kv_blocks=16), Traffic(isl=256, osl=16, rate=1.0), SLO_, OPTIONS)
    with pytest.raises(ValueError, match="--kv-transport ipc: the profile measured grpc"):
        plan(PROFILE, Traffic(isl=1024, osl=256, rate=1.0), SLO_, PlanOptions(transport="ipc"))


def test_the_kv_capacity_caps_the_batch() -> None:
    # 64 blocks of 16 tokens hold 3 requests of 256 + 64 tokens: --max-num-seqs candidates above it are not tried
    small = synthetic_profile(num_kv_blocks=64)
    traffic = Traffic(isl=256, osl=64, rate=1.0)
    assert {l.max_num_seqs for l in layouts(small, traffic, OPTIONS)} == {3}
    assert math.isfinite(plan(small, traffic, SLO_, OPTIONS).best.ttft_p50_s)


def test_the_planner_imports_no_torch() -> None:
    """plan runs anywhere: the planner's modules (all but the profiler) and the CLI's parser leave torch out."""
    import subprocess
    import sys

    modules = ["deploy.planner." + m for m in ("fit", "profile", "queueing", "finite_run", "planner", "render",
                                               "validate", "commands")]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "from deploy.cli import build_parser\nbuild_parser()\n"
        "print(sorted(name for name in ('torch', 'numpy') if name in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
