"""n > 1 at the scheduler: choices forked off a computed prompt share its full blocks (counted once), compute the
rest of the prompt in blocks of their own, and give every reference back on finish and abort; disaggregated, the
fork happens at commit (engine/core/fork.py)."""

from __future__ import annotations

from engine.core.fork import choice_params, choice_request_id
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from tests.engine.core.scheduler_harness import EOS, NS, FakeModel, make_request, make_scheduler, prompt, run, step


def _with_choices(parent: Request, n: int) -> Request:
    parent.pending_forks = [
        Request(choice_request_id(parent.request_id, i), parent.prompt_token_ids,
                choice_params(parent.sampling_params, i), eos_token_ids=(EOS,), max_tokens=parent.max_tokens,
                hash_namespace=NS, index=i)
        for i in range(1, n)
    ]
    return parent


def _ref_counts(sched: Scheduler, request_id: str) -> list[int]:
    return [sched.kv_cache.pool.blocks[b].ref_cnt for b in sched.kv_cache.block_ids(request_id)]


def test_forked_choices_share_the_full_prompt_blocks_and_free_them_all() -> None:
    sched, pool = make_scheduler(num_blocks=16)
    parent = _with_choices(make_request("r", prompt(10), max_tokens=3, seed=5), 4)
    sched.add_request(parent)

    trace, _, produced = step(sched, FakeModel())
    assert trace == [("r", 0, 10)] and produced == [("r", 7)]  # the prompt is computed once, by choice 0
    assert sched.kv_cache.block_ids("r") == [0, 1, 2]
    for i in (1, 2, 3):  # forked: blocks 0 and 1 (full, computed) shared; t8 t9 left to compute
        child = sched.requests[f"r#{i}"]
        assert child.status is RequestStatus.WAITING and child.num_computed_tokens == 8
        assert child.sampling_params.seed == 5 + i and child.sampling_params.n == 1
        assert sched.kv_cache.block_ids(f"r#{i}") == [0, 1]
    assert [r.request_id for r in sched.waiting] == ["r#1", "r#2", "r#3"]
    assert _ref_counts(sched, "r") == [4, 4, 1]
    assert pool.num_used_blocks == 3

    trace, _, _ = step(sched, FakeModel())
    assert trace == [("r", 10, 1), ("r#1", 8, 2), ("r#2", 8, 2), ("r#3", 8, 2)]
    assert [sched.kv_cache.block_ids(f"r#{i}") for i in (1, 2, 3)] == [[0, 1, 3], [0, 1, 4], [0, 1, 5]]
    assert pool.num_used_blocks == 2 + 4  # the prompt's full blocks once, then one block per choice

    run(sched, FakeModel())
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in [parent, *parent.pending_forks])
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 16


def test_a_short_prompt_shares_nothing_and_every_choice_computes_it() -> None:
    sched, pool = make_scheduler(num_blocks=16)
    parent = _with_choices(make_request("r", prompt(4), max_tokens=2), 2)  # (4 - 1) // 4 = 0 full blocks to share
    sched.add_request(parent)
    step(sched, FakeModel())
    trace, _, _ = step(sched, FakeModel())
    assert trace == [("r", 4, 1), ("r#1", 0, 4)]
    run(sched, FakeModel())
    assert pool.num_used_blocks == 0


def test_a_prompt_one_past_a_block_boundary_shares_its_full_blocks() -> None:
    sched, pool = make_scheduler(num_blocks=16)
    sched.add_request(_with_choices(make_request("r", prompt(9), max_tokens=2), 2))  # (9 - 1) // 4 = 2 shared
    step(sched, FakeModel())
    trace, _, _ = step(sched, FakeModel())
    assert trace == [("r", 9, 1), ("r#1", 8, 1)] and sched.kv_cache.block_ids("r#1") == [0, 1, 3]
    run(sched, FakeModel())
    assert pool.num_used_blocks == 0


def test_abort_of_every_choice_after_the_fork_frees_every_reference() -> None:
    sched, pool = make_scheduler(num_blocks=16)
    sched.add_request(_with_choices(make_request("r", prompt(10), max_tokens=8), 3))
    step(sched, FakeModel())
    step(sched, FakeModel())
    assert pool.num_used_blocks == 2 + 3
    sched.abort_requests(["r", "r#1", "r#2"])
    assert pool.num_used_blocks == 0 and not sched.has_unfinished_requests()


def test_a_finished_parent_leaves_its_choices_their_shared_blocks() -> None:
    sched, pool = make_scheduler(num_blocks=16)
    parent = _with_choices(make_request("r", prompt(10), max_tokens=1), 2)  # choice 0 ends on its first token
    sched.add_request(parent)
    step(sched, FakeModel())
    assert parent.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv_cache.block_ids("r#1") == [0, 1] and _ref_counts(sched, "r#1") == [1, 1]
    run(sched, FakeModel())
    assert pool.num_used_blocks == 0


def test_disaggregated_choices_fork_at_commit() -> None:
    sched, pool = make_scheduler(num_blocks=16)
    parent = _with_choices(make_request("d", prompt(10), max_tokens=3), 3)
    assert sched.reserve_remote(parent)
    assert sched.kv_cache.block_ids("d") == [0, 1, 2] and not sched.requests.keys() - {"d"}
    assert sched.commit_remote(parent, 50) is None  # the KV arrived: choices 1, 2 fork off its blocks
    assert [r.request_id for r in sched.waiting] == ["d", "d#1", "d#2"]
    assert _ref_counts(sched, "d") == [3, 3, 1]
    trace, _, _ = step(sched, FakeModel())
    assert trace == [("d", 10, 1), ("d#1", 8, 2), ("d#2", 8, 2)]
    assert pool.num_used_blocks == 2 + 3
    run(sched, FakeModel())
    assert pool.num_used_blocks == 0
