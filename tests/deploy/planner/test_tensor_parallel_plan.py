"""The planner's tensor-parallel sizes (issue 37: "TP sizes once they exist"): a profile's `tensor_parallel` (each
size's times over size 1's on the same cores) scales its pool's compute; the search tries every pool at every
measured size within --max-workers ranks; a worker of size N counts N; the recommendation names its sizes as
`serve` flags and Helm values. Pure: synthetic profiles, no torch."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deploy.planner.planner import SLO, Layout, LayoutModel, PlanOptions, Traffic, host_share_slowdown, layouts, plan
from deploy.planner.profile import TPScale, load_profile
from deploy.planner.render import helm_values, serve_flags
from tests.deploy.planner.synthetic import synthetic_profile

BASE = synthetic_profile()
# Size 2: prefill at 0.55x size 1's time, decode at 0.8x (its all-reduces eat some of the split).
# A worker of size 2 holds twice the blocks (the KV flags size each rank, which holds half of each block).
WIDE = dataclasses.replace(BASE, tensor_parallel={2: TPScale(prefill=0.55, decode=0.8, threads_per_rank=1,
                                                             num_kv_blocks=2 * BASE.kv.num_blocks)})


def test_a_profile_without_sizes_plans_size_1_only_as_before() -> None:
    traffic = Traffic(isl=512, osl=64, rate=1.0)
    found = layouts(BASE, traffic, PlanOptions(max_workers=4))
    assert {(lay.tp, lay.prefill_tp, lay.decode_tp) for lay in found} == {(1, 1, 1)}
    assert all(lay.num_ranks == lay.num_workers for lay in found)


def test_every_pool_is_searched_at_every_measured_size_within_the_ranks() -> None:
    found = layouts(WIDE, Traffic(isl=512, osl=64, rate=1.0), PlanOptions(max_workers=4))
    assert {(lay.prefill_tp, lay.decode_tp) for lay in found if not lay.colocated} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert {lay.tp for lay in found if lay.colocated} == {1, 2}
    assert max(lay.num_ranks for lay in found) == 4
    assert Layout(num_prefill=1, num_decode=1, max_num_seqs=8, prefill_tp=2, decode_tp=2).num_ranks == 4
    assert Layout(num_prefill=2, num_decode=1, max_num_seqs=8, prefill_tp=2).label == "2P(TP2)+1D, seqs 8"
    assert Layout(num_colocated=3, max_num_seqs=8, tp=2).label == "colocated(TP2) x3, seqs 8"


def test_a_pools_size_scales_its_compute_by_the_measured_ratio() -> None:
    traffic = Traffic(isl=1024, osl=64, rate=0.2)
    one = LayoutModel(WIDE, traffic, Layout(num_prefill=1, num_decode=1, max_num_seqs=8), PlanOptions())
    two = LayoutModel(WIDE, traffic, Layout(num_prefill=1, num_decode=1, max_num_seqs=8, prefill_tp=2),
                      PlanOptions())
    assert two.prefill_s == pytest.approx(0.55 * one.prefill_s)
    assert two.step_s(4) == pytest.approx(one.step_s(4))  # the decode pool stayed at size 1
    wide_decode = LayoutModel(WIDE, traffic, Layout(num_prefill=1, num_decode=1, max_num_seqs=8, decode_tp=2),
                              PlanOptions())
    assert wide_decode.step_s(4) == pytest.approx(0.8 * one.step_s(4))


def test_a_ttft_slo_only_a_wider_prefill_pool_meets_is_met_by_one() -> None:
    """A lone 2,048-token prompt prefills in ~1.45 s at size 1 and ~0.8 s at size 2: a 1.2 s TTFT SLO at a low rate
    is met only by layouts that prefill at size 2, and the plan says how to serve it."""
    traffic = Traffic(isl=2048, osl=32, rate=0.05)
    slo = SLO(ttft_s=1.2, tpot_s=0.2)
    result = plan(WIDE, traffic, slo, PlanOptions(max_workers=6))
    assert result.met, result.problem
    assert result.best.layout.prefill_pool_tp == 2
    assert all(p.layout.prefill_pool_tp == 2 for p in result.ranked if p.meets)
    flags = serve_flags(WIDE, result.best.layout)
    if result.best.layout.colocated:
        assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    else:
        assert flags[flags.index("--prefill-tensor-parallel-size") + 1] == "2"
    with pytest.raises(ValueError, match="below the profile's floor"):
        plan(BASE, traffic, slo, PlanOptions(max_workers=6))  # size 1 alone cannot


def test_fewest_ranks_win_among_layouts_that_meet() -> None:
    """An easy SLO: size 1 meets with fewer ranks, so it ranks first; a size-2 pool costs two ranks."""
    result = plan(WIDE, Traffic(isl=256, osl=32, rate=0.2), SLO(ttft_s=3.0, tpot_s=0.5), PlanOptions(max_workers=6))
    meeting = [p for p in result.ranked if p.meets]
    assert meeting[0].layout.num_ranks == 1
    assert [p.layout.num_ranks for p in meeting] == sorted(p.layout.num_ranks for p in meeting)


def test_on_one_host_the_cores_are_split_between_every_rank() -> None:
    """2 cores: one worker of size 2 holds both (a thread a rank, as measured); two of size 2 time-share them."""
    assert host_share_slowdown(WIDE, 1, "prefill", num_ranks=2, tp=2) == 1.0
    assert host_share_slowdown(WIDE, 2, "prefill", num_ranks=4, tp=2) == pytest.approx(2.0)
    assert host_share_slowdown(WIDE, 2, "prefill") == host_share_slowdown(WIDE, 2, "prefill", num_ranks=2, tp=1)


def test_helm_values_carry_each_pools_size() -> None:
    result = plan(WIDE, Traffic(isl=2048, osl=32, rate=0.05), SLO(ttft_s=1.2, tpot_s=0.2), PlanOptions(max_workers=6))
    values, _ = helm_values(WIDE, result)
    chosen = next(p for p in result.ranked if not p.layout.colocated and p.meets).layout
    assert values["prefill"]["tensorParallelSize"] == chosen.prefill_tp == 2
    assert values["decode"]["tensorParallelSize"] == chosen.decode_tp


def test_the_sizes_survive_the_profiles_json_and_bad_ones_are_clear_errors(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "profile.json"
    WIDE.write(path)
    assert load_profile(path).tensor_parallel == WIDE.tensor_parallel
    data = json.loads(path.read_text())
    good = {"prefill": 1, "decode": 1, "threads_per_rank": 1, "num_kv_blocks": 8}
    for bad, match in (({"1": good}, "sizes are integers >= 2"),
                       ({"2": {**good, "prefill": 0}}, "positive ratios"),
                       ({"2": {**good, "num_kv_blocks": 0}}, "num_kv_blocks >= 1"),
                       ({"2": {"prefill": 1, "decode": 1}}, "missing threads_per_rank")):
        path.write_text(json.dumps({**data, "tensor_parallel": bad}))
        with pytest.raises(ValueError, match=match):
            load_profile(path)
    path.write_text(json.dumps({**data, "engine": {**data["engine"], "tensor_parallel_size": 2}}))
    with pytest.raises(ValueError, match="ratios are over size 1, but the profile ran at size 2"):
        load_profile(path)


def test_a_pool_at_a_size_holds_that_sizes_kv_blocks() -> None:
    """The KV flags size each rank: a decode worker of size 2 holds the profile's blocks at that size (here twice
    size 1's), so its batch is capped by those, and larger --max-num-seqs become candidates."""
    traffic = Traffic(isl=8000, osl=100, rate=0.1)  # 507 blocks a request: 5 fit at size 1, 11 at size 2
    one = LayoutModel(WIDE, traffic, Layout(num_prefill=1, num_decode=1, max_num_seqs=64), PlanOptions())
    two = LayoutModel(WIDE, traffic, Layout(num_prefill=1, num_decode=1, max_num_seqs=64, decode_tp=2),
                      PlanOptions())
    assert (one.slots, two.slots) == (5, 11)
    found = layouts(WIDE, traffic, PlanOptions(max_workers=3))
    assert {lay.max_num_seqs for lay in found if lay.colocated and lay.tp == 1} == {5}
    assert {lay.max_num_seqs for lay in found if lay.colocated and lay.tp == 2} == {8}


def test_the_floor_counts_only_sizes_the_workers_allow() -> None:
    traffic = Traffic(isl=2048, osl=32, rate=0.05)
    slo = SLO(ttft_s=1.2, tpot_s=0.2)  # only a size-2 prefill meets it
    with pytest.raises(ValueError, match="below the profile's floor"):
        plan(WIDE, traffic, slo, PlanOptions(max_workers=1))  # no room for a worker of size 2


def test_a_prompt_prefilled_locally_runs_at_the_decode_pools_size() -> None:
    traffic = Traffic(isl=512, osl=32, rate=0.2)
    local = Layout(num_prefill=1, num_decode=1, max_num_seqs=8, prefill_threshold_tokens=4096, decode_tp=2)
    remote = Layout(num_prefill=1, num_decode=1, max_num_seqs=8, decode_tp=2)
    assert LayoutModel(WIDE, traffic, local, PlanOptions()).prefill_slowdown == pytest.approx(0.55)
    assert LayoutModel(WIDE, traffic, remote, PlanOptions()).prefill_slowdown == 1.0


def test_validate_reads_a_planned_layouts_sizes_back() -> None:
    from deploy.planner.validate import _layout

    planned = Layout(num_prefill=1, num_decode=2, max_num_seqs=16, prefill_tp=2, transport="grpc")
    values = {**dataclasses.asdict(planned), "label": planned.label, "num_workers": 3, "num_ranks": 4}
    assert _layout(values, WIDE) == planned
    with pytest.raises(ValueError, match=r"runs tensor-parallel size\(s\) \[2\], which this profile did not measure"):
        _layout(values, BASE)
