"""The routing policy on exact snapshots: which worker each rule picks, and when there is none."""

from __future__ import annotations

import pytest

from router.routing import (
    TIER_LOAD_COST,
    NoWorkerError,
    WorkerLoad,
    num_blocks_needed,
    pick_decode_worker,
    pick_prefill_worker,
    plan_route,
)


def load(worker_id: str, role: str = "decode", *, healthy: bool = True, running: int = 0, waiting: int = 0,
         receiving: int = 0, pending: int = 0, free: int = 100, total: int = 100) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, endpoint=f"{worker_id}:1", healthy=healthy,
                      num_running=running, num_waiting=waiting, num_receiving_kv=receiving, num_pending=pending,
                      kv_blocks_free=free, kv_blocks_total=total)


def test_num_blocks_needed_counts_the_prompt_and_one_token() -> None:
    assert num_blocks_needed(15, 16) == 1
    assert num_blocks_needed(16, 16) == 2  # the first generated token opens block 2
    assert num_blocks_needed(1, 1) == 2


def test_decode_fewest_queued_then_most_free_blocks_then_id() -> None:
    loads = [load("a", running=2), load("b", running=1, waiting=1), load("c", running=1, free=50),
             load("d", waiting=1, free=60)]
    assert pick_decode_worker(loads, num_blocks=1).worker_id == "d"  # 1 queued and more free than c
    loads = [load("b", pending=1), load("a", running=1)]
    assert pick_decode_worker(loads, num_blocks=1).worker_id == "a"  # ties on queue and blocks: by id
    assert pick_decode_worker([load("a", pending=2), load("b", running=1)], num_blocks=1).worker_id == "b"
    # Requests whose prompt KV is still on its way are the worker's to decode: they count as its queue.
    assert pick_decode_worker([load("a", receiving=2), load("b", running=1)], num_blocks=1).worker_id == "b"


def test_decode_skips_unhealthy_and_other_roles() -> None:
    loads = [load("a", healthy=False), load("b", running=9), load("p", role="prefill")]
    assert pick_decode_worker(loads, num_blocks=1).worker_id == "b"
    with pytest.raises(NoWorkerError, match="no healthy decode worker"):
        pick_decode_worker([load("a", healthy=False), load("p", role="prefill")], num_blocks=1)


def test_decode_room() -> None:
    # Room now beats a shorter queue; a cache that could never hold the request is skipped altogether.
    loads = [load("idle-full", free=3), load("busy-roomy", running=5, free=40), load("tiny", total=8, free=8)]
    assert pick_decode_worker(loads, num_blocks=10).worker_id == "busy-roomy"
    # No room anywhere right now: the least loaded that could ever hold it takes it (and queues it).
    loads = [load("a", running=2, free=3), load("b", running=1, free=1), load("tiny", total=8, free=8)]
    assert pick_decode_worker(loads, num_blocks=10).worker_id == "b"
    with pytest.raises(NoWorkerError, match="can hold 200 KV blocks"):
        pick_decode_worker(loads, num_blocks=200)
    # A worker that has not reported its cache (total 0) is not judged on room.
    assert pick_decode_worker([load("new", free=0, total=0)], num_blocks=200).worker_id == "new"


def test_prefill_by_load_without_overlap() -> None:
    loads = [load("p0", "prefill", running=1), load("p1", "prefill"), load("d", "decode")]
    assert pick_prefill_worker(loads, num_blocks=4).worker_id == "p1"


def test_prefill_prefix_overlap_against_load() -> None:
    loads = [load("p0", "prefill", running=1), load("p1", "prefill")]
    # A queued request is priced at the least any worker computes (here p0's 2 blocks): 2 + 2 < 10 for idle p1.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 8}).worker_id == "p0"
    # ... until p0's queue costs more than computing the whole prompt on p1: 2 + 5 x 2 = 12 > 10.
    busy = [load("p0", "prefill", running=5), load("p1", "prefill")]
    assert pick_prefill_worker(busy, num_blocks=10, prefix_overlap_blocks={"p0": 8}).worker_id == "p1"
    # Full overlap: the penalty is at least one block, so 0 + 1 < 10.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 10}).worker_id == "p0"
    # An explicit penalty: the pre-index rule, one queued request as costly as this whole request: 2 + 10 > 10.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 8},
                               load_penalty_blocks=10).worker_id == "p1"
    # Overlap scores beyond the prompt or below zero are clipped: 0 + 2 vs 10 + 0.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 99, "p1": -5},
                               load_penalty_blocks=2).worker_id == "p0"
    # Without overlaps every worker computes everything: the penalty is the whole request, the least loaded wins.
    assert pick_prefill_worker(loads, num_blocks=10).worker_id == "p1"


def test_prefill_prices_a_hit_below_the_device_as_a_fraction_of_a_computed_block() -> None:
    loads = [load("p0", "prefill"), load("p1", "prefill")]
    # Both hold the prompt's 8 leading blocks of 10; p0 keeps 4 of them on disk: 2 + 4 x 0.25 = 3 against 2.
    overlap = {"p0": 8, "p1": 8}
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks=overlap).worker_id == "p0"  # tie: by id
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks=overlap,
                               prefix_tier_blocks={"p0": {"disk": 4}}).worker_id == "p1"
    # A disk hit still beats computing: p0 holds all 10 on disk (2.5), p1 holds 6 on its device (4).
    assert TIER_LOAD_COST["disk"] == 0.25
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 10, "p1": 6},
                               prefix_tier_blocks={"p0": {"disk": 10}}).worker_id == "p0"
    # Host memory is cheaper than disk: 10 x 0.1 = 1 against 10 x 0.25 = 2.5.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 10, "p1": 10},
                               prefix_tier_blocks={"p0": {"disk": 10}, "p1": {"host": 10}}).worker_id == "p1"
    # A queued request is priced at the least priced cost anywhere (2.5 here): p0's 2.5 + 2 x 2.5 = 7.5 loses to p1's
    # 6 computed blocks (priced as if on the device, 0 + 2 x 1 = 2, it would stay on p0); one queued stays (5 < 6).
    busy = [load("p0", "prefill", running=2), load("p1", "prefill")]
    assert pick_prefill_worker(busy, num_blocks=10, prefix_overlap_blocks={"p0": 10, "p1": 4},
                               prefix_tier_blocks={"p0": {"disk": 10}}).worker_id == "p1"
    busy = [load("p0", "prefill", running=1), load("p1", "prefill")]
    assert pick_prefill_worker(busy, num_blocks=10, prefix_overlap_blocks={"p0": 10, "p1": 4},
                               prefix_tier_blocks={"p0": {"disk": 10}}).worker_id == "p0"
    # Tier counts are clipped to what is held; a tier the router does not know costs as much as computing.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 4, "p1": 3},
                               prefix_tier_blocks={"p0": {"disk": 99}}).worker_id == "p0"  # 6 + 1 < 7
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 4, "p1": 3},
                               prefix_tier_blocks={"p0": {"tape": 4}}).worker_id == "p1"  # 6 + 4 > 7


def test_plan_route_passes_tiers_to_the_worker_that_runs_the_prompt() -> None:
    loads = [load("p0", "prefill"), load("p1", "prefill"), load("d", "decode"), load("c0", "colocated"),
             load("c1", "colocated")]
    overlap = {"p0": 8, "p1": 8, "c0": 8, "c1": 8}
    tiers = {"p0": {"disk": 8}, "c0": {"disk": 8}}
    route = plan_route("disaggregated", loads, num_blocks=10, prefix_overlap_blocks=overlap, prefix_tier_blocks=tiers)
    assert route.prefill is not None and route.prefill.worker_id == "p1"
    assert plan_route("colocated", loads, num_blocks=10, prefix_overlap_blocks=overlap,
                      prefix_tier_blocks=tiers).target.worker_id == "c1"
    # Not under another policy: least-loaded ties by id.
    assert plan_route("colocated", loads, num_blocks=10, policy="least-loaded", prefix_overlap_blocks=overlap,
                      prefix_tier_blocks=tiers).target.worker_id == "c0"


def test_plan_route_modes() -> None:
    loads = [load("p", "prefill"), load("d", "decode"), load("c", "colocated", running=1),
             load("c2", "colocated", running=1)]
    route = plan_route("disaggregated", loads, num_blocks=1)
    assert route.target.worker_id == "d" and route.prefill is not None and route.prefill.worker_id == "p"
    route = plan_route("colocated", loads, num_blocks=4)
    assert route.target.worker_id == "c" and route.prefill is None
    route = plan_route("colocated", loads, num_blocks=4, prefix_overlap_blocks={"c2": 4})
    assert route.target.worker_id == "c2"  # the colocated worker runs the prefill too: overlap counts
    with pytest.raises(NoWorkerError, match="no healthy prefill worker"):
        plan_route("disaggregated", [load("d", "decode")], num_blocks=1)
    with pytest.raises(NoWorkerError, match="no healthy colocated worker"):
        plan_route("colocated", [load("d", "decode")], num_blocks=1)


def test_decode_overlap_against_load() -> None:
    loads = [load("d0", running=1), load("d1")]
    # d0 holds all 10 blocks: 0 lacking + 10 for its queued request = 10 ties idle d1's 10 lacking; then more
    # free blocks win, then the id.
    assert pick_decode_worker(loads, num_blocks=10, prefix_overlap_blocks={"d0": 10}).worker_id == "d0"
    loads = [load("d0", running=1, free=50), load("d1")]
    assert pick_decode_worker(loads, num_blocks=10, prefix_overlap_blocks={"d0": 10}).worker_id == "d1"
    # Overlap on an idle worker always wins.
    loads = [load("d0"), load("d1")]
    assert pick_decode_worker(loads, num_blocks=10, prefix_overlap_blocks={"d1": 3}).worker_id == "d1"


def test_policies() -> None:
    loads = [load("p0", "prefill"), load("p1", "prefill", running=3), load("p2", "prefill", healthy=False),
             load("d0", "decode", running=2), load("d1", "decode")]
    overlap = {"p1": 10, "d0": 10}
    route = plan_route("disaggregated", loads, num_blocks=10, policy="prefix-aware", prefix_overlap_blocks=overlap)
    # p1 holds the whole prompt: 0 + 3 queued x 1 < 10 on idle p0; d0's queue of 2 outweighs its overlap (20 > 10).
    assert (route.prefill.worker_id, route.target.worker_id) == ("p1", "d1")
    route = plan_route("disaggregated", loads, num_blocks=10, policy="prefix-aware",
                       prefix_overlap_blocks={"p0": 10, "d1": 10})
    assert (route.prefill.worker_id, route.target.worker_id) == ("p0", "d1")
    # least-loaded ignores overlaps; round-robin takes turns over healthy workers in id order, ignoring load.
    route = plan_route("disaggregated", loads, num_blocks=10, policy="least-loaded",
                       prefix_overlap_blocks={"p1": 10, "d0": 10})
    assert (route.prefill.worker_id, route.target.worker_id) == ("p0", "d1")
    turns = [plan_route("disaggregated", loads, num_blocks=10, policy="round-robin", turn=t) for t in range(4)]
    assert [(r.prefill.worker_id, r.target.worker_id) for r in turns] == [
        ("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]
    with pytest.raises(ValueError, match="routing policy"):
        plan_route("disaggregated", loads, num_blocks=10, policy="random")


def test_conditional_disaggregation() -> None:
    loads = [load("p0", "prefill"), load("d0", "decode")]
    # 100-token prompt, blocks of 16: d0 holds 5 blocks (80 tokens), 20 tokens left to compute.
    local = plan_route("disaggregated", loads, num_blocks=7, prefix_overlap_blocks={"d0": 5},
                       num_prompt_tokens=100, block_size=16, local_prefill_threshold_tokens=20)
    assert local.prefill is None and local.target.worker_id == "d0" and local.prefill_worker.worker_id == "d0"
    remote = plan_route("disaggregated", loads, num_blocks=7, prefix_overlap_blocks={"d0": 5},
                        num_prompt_tokens=100, block_size=16, local_prefill_threshold_tokens=19)
    assert remote.prefill is not None and remote.prefill_worker.worker_id == "p0"
    # A short prompt goes local whatever the policy; 0 turns it off.
    for policy in ("least-loaded", "round-robin"):
        route = plan_route("disaggregated", loads, num_blocks=1, policy=policy, num_prompt_tokens=8,
                           local_prefill_threshold_tokens=8)
        assert route.prefill is None
    route = plan_route("disaggregated", loads, num_blocks=1, num_prompt_tokens=8, local_prefill_threshold_tokens=0)
    assert route.prefill is not None
    # Colocated mode has no prefill worker to skip.
    assert plan_route("colocated", [load("c", "colocated")], num_blocks=1, num_prompt_tokens=8,
                      local_prefill_threshold_tokens=64).prefill is None
