"""The routing policy on exact snapshots: which worker each rule picks, and when there is none."""

from __future__ import annotations

import pytest

from router.routing import (
    NoWorkerError,
    WorkerLoad,
    num_blocks_needed,
    pick_decode_worker,
    pick_prefill_worker,
    plan_route,
)


def load(worker_id: str, role: str = "decode", *, healthy: bool = True, running: int = 0, waiting: int = 0,
         pending: int = 0, free: int = 100, total: int = 100) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, endpoint=f"{worker_id}:1", healthy=healthy,
                      num_running=running, num_waiting=waiting, num_pending=pending, kv_blocks_free=free,
                      kv_blocks_total=total)


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
    # p0 holds 8 of 10 blocks: 2 to compute + 10 for its queued request = 12 > 10 for idle p1.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 8}).worker_id == "p1"
    # Full overlap only ties (0 + 10 vs 10): the shorter queue wins.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 10}).worker_id == "p1"
    # A cheaper queue makes overlap count for more: 2 + 2 < 10.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 8},
                               load_penalty_blocks=2).worker_id == "p0"
    # Overlap scores beyond the prompt or below zero are clipped: 0 + 2 vs 10 + 0.
    assert pick_prefill_worker(loads, num_blocks=10, prefix_overlap_blocks={"p0": 99, "p1": -5},
                               load_penalty_blocks=2).worker_id == "p0"


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
