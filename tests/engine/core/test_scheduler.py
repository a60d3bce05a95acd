"""Scheduler on exact state: tokens scheduled per request and step, block tables, preemption, prefix hits.

A fake "model" (scheduler_harness.FakeModel) stands in for the runtime.
"""

from __future__ import annotations


import pytest

from engine.core.request import RequestStatus
from engine.core.scheduler import SchedulerConfig
from kv_transfer.kv_events import BlockRemoved, BlockStored
from tests.engine.core.scheduler_harness import (
    AllFree,
    FakeModel,
    make_request,
    make_scheduler,
    prompt,
    run,
    step,
)

# -- config and output -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
@pytest.mark.parametrize("value", [0, -1])
def test_config_values_must_be_positive(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: value})  # type: ignore[arg-type]


def test_scheduled_request_samples_only_at_the_end_of_its_tokens() -> None:
    """`samples` is read by the runtime between schedule() and update_from_output()."""
    scheduler, pool = make_scheduler(max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", prompt(4, 100), max_tokens=2))
    scheduler.add_request(make_request("b", prompt(5, 200), max_tokens=2))
    out = scheduler.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 0, 4, True),
        ("b", 0, 2, False),
    ]
    assert out.num_batched_tokens == 6
    assert not out.is_empty
    scheduler.update_from_output(out, {"a": [7]})
    out = scheduler.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 4, 1, True),
        ("b", 2, 3, True),
    ]
    scheduler.update_from_output(out, {"a": [7], "b": [7]})
    scheduler.abort_requests(["b"])
    assert pool.num_free_blocks == pool.num_blocks


def test_empty_scheduler_schedules_nothing() -> None:
    scheduler, pool = make_scheduler()
    out = scheduler.schedule()
    assert out.is_empty
    assert out.num_batched_tokens == 0
    assert out.preempted == []
    assert scheduler.update_from_output(out, {}) == []
    assert not scheduler.has_unfinished_requests()


# -- token budget ----------------------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_across_steps(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", prompt(20), max_tokens=3)
    scheduler.add_request(a)
    model = FakeModel({"a": 11})

    expected = [
        # trace,          block table,          produced
        ([("a", 0, 8)], [0, 1], []),
        ([("a", 8, 8)], [0, 1, 2, 3], []),
        ([("a", 16, 4)], [0, 1, 2, 3, 4], [("a", 11)]),  # the last prompt chunk samples
        ([("a", 20, 1)], [0, 1, 2, 3, 4, 5], [("a", 11)]),
        ([("a", 21, 1)], [0, 1, 2, 3, 4, 5], [("a", 11)]),
    ]
    for want_trace, want_blocks, want_produced in expected:
        assert a.status in (RequestStatus.WAITING, RequestStatus.RUNNING)
        trace, out, produced = step(scheduler, model)
        assert trace == want_trace
        assert out.scheduled[0].block_ids == want_blocks
        assert produced == want_produced

    assert a.status is RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"
    assert a.output_token_ids == [11, 11, 11]
    assert a.all_token_ids == prompt(20) + [11, 11, 11]
    assert a.num_computed_tokens == 22
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().is_empty

    # Full computed blocks became cache as they were computed: 2, 2, then 1 (22 computed = 5 full blocks).
    assert [len(e.block_hashes) for e in pool.take_events() if isinstance(e, BlockStored)] == [2, 2, 1]
    assert pool.num_cached_blocks == 5
    assert pool.free_block_ids() == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 4, 3, 2, 1, 0]
    assert_all_blocks_free(pool)


def test_budget_is_shared_and_decode_takes_one_token_per_step(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", prompt(8, 100), max_tokens=3))
    scheduler.add_request(make_request("b", prompt(8, 200), max_tokens=3))
    model = FakeModel()

    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 0, 8), ("b", 0, 2)]  # b gets what is left of the budget
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2]]
    assert produced == [("a", 7)]

    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 8, 1), ("b", 2, 6)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1, 3], [2, 4]]
    assert produced == [("a", 7), ("b", 7)]

    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 9, 1), ("b", 8, 1)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1, 3], [2, 4, 5]]
    assert produced == [("a", 7), ("b", 7)]  # a's third token: a finishes

    trace, out, produced = step(scheduler, model)
    assert trace == [("b", 9, 1)]
    assert produced == [("b", 7)]
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(pool)


def test_running_requests_are_scheduled_before_waiting_ones(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", prompt(10, 100), max_tokens=2))
    scheduler.add_request(make_request("b", prompt(4, 200), max_tokens=2))
    traces = run(scheduler, FakeModel())
    assert traces == [
        [("a", 0, 4)],  # the budget is spent: b waits
        [("a", 4, 4)],  # a, running, goes first again
        [("a", 8, 2), ("b", 0, 2)],
        [("a", 10, 1), ("b", 2, 2)],  # a finishes
        [("b", 4, 1)],  # b finishes
    ]
    assert scheduler.num_waiting == 0 and scheduler.num_running == 0
    assert_all_blocks_free(pool)


def test_max_num_seqs_caps_admissions(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=8, max_num_seqs=2)
    for rid, first in (("a", 100), ("b", 200), ("c", 300)):
        scheduler.add_request(make_request(rid, prompt(4, first), max_tokens=2))
    model = FakeModel()

    trace, out, _ = step(scheduler, model)
    assert trace == [("a", 0, 4), ("b", 0, 4)]
    assert [s.block_ids for s in out.scheduled] == [[0], [1]]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert scheduler.requests["c"].status is RequestStatus.WAITING

    trace, out, _ = step(scheduler, model)
    assert trace == [("a", 4, 1), ("b", 4, 1)]  # c still waits; a and b finish
    assert [s.block_ids for s in out.scheduled] == [[0, 2], [1, 3]]
    assert pool.free_block_ids() == [4, 5, 6, 7, 2, 0, 3, 1]

    trace, out, _ = step(scheduler, model)
    assert trace == [("c", 0, 4)]
    assert out.scheduled[0].block_ids == [4]
    trace, out, _ = step(scheduler, model)
    assert trace == [("c", 4, 1)]
    assert out.scheduled[0].block_ids == [4, 5]
    assert not scheduler.has_unfinished_requests()
    assert pool.free_block_ids() == [6, 7, 2, 0, 3, 1, 5, 4]
    assert_all_blocks_free(pool)


def test_a_request_joins_mid_flight_and_another_leaves(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler()
    a = make_request("a", prompt(6, 100), max_tokens=4)
    scheduler.add_request(a)
    model = FakeModel({"a": 11, "b": 22, "c": 33})

    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 0, 6)]
    assert produced == [("a", 11)]

    b = make_request("b", prompt(5, 200), max_tokens=2)
    scheduler.add_request(b)
    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 6, 1), ("b", 0, 5)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2, 3]]
    assert produced == [("a", 11), ("b", 22)]

    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 7, 1), ("b", 5, 1)]
    assert produced == [("a", 11), ("b", 22)]
    assert b.status is RequestStatus.FINISHED_LENGTH  # b leaves
    assert list(scheduler.requests) == ["a"]
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 2]

    c = make_request("c", prompt(3, 300), max_tokens=1)
    scheduler.add_request(c)
    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 8, 1), ("c", 0, 3)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1, 4], [5]]
    assert produced == [("a", 11), ("c", 33)]

    assert not scheduler.has_unfinished_requests()
    assert (a.output_token_ids, b.output_token_ids, c.output_token_ids) == ([11] * 4, [22] * 2, [33])
    assert_all_blocks_free(pool)


# -- preemption ------------------------------------------------------------------------------------------------


def test_preemption_when_blocks_run_out(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=4, max_num_seqs=2, prefix_caching=False)
    a = make_request("a", prompt(8, 100), max_tokens=3)
    b = make_request("b", prompt(7, 200), max_tokens=3)
    c = make_request("c", prompt(3, 300), max_tokens=1)
    for r in (a, b, c):
        scheduler.add_request(r)
    model = FakeModel({"a": 11, "b": 22, "c": 33})

    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 0, 8), ("b", 0, 7)]  # c: max_num_seqs
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2, 3]]
    assert produced == [("a", 11), ("b", 22)]
    assert pool.free_block_ids() == []

    # a's 9th token needs a third block: b, the most recently admitted, is preempted to make room.
    trace, out, produced = step(scheduler, model)
    assert out.preempted == ["b"]
    assert trace == [("a", 8, 1)]
    assert out.scheduled[0].block_ids == [0, 1, 3]  # b's blocks came back tail first: [3, 2]
    assert produced == [("a", 11)]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [22]  # tokens kept
    assert b.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    assert scheduler.kv_cache.block_ids("b") == []
    assert list(scheduler.waiting) == [b, c]  # front of the queue
    assert scheduler.running == [a]
    assert pool.free_block_ids() == [2]

    # b needs 2 blocks to recompute, 1 is free: it waits, and c waits behind it.
    trace, out, produced = step(scheduler, model)
    assert trace == [("a", 9, 1)]
    assert out.preempted == []
    assert produced == [("a", 11)]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert pool.free_block_ids() == [2, 3, 1, 0]

    # b resumes: it recomputes prompt + its one output token, and samples its second token.
    trace, out, produced = step(scheduler, model)
    assert trace == [("b", 0, 8), ("c", 0, 3)]
    assert [s.block_ids for s in out.scheduled] == [[2, 3], [1]]
    assert produced == [("b", 22), ("c", 33)]
    assert b.status is RequestStatus.RUNNING

    trace, out, produced = step(scheduler, model)
    assert trace == [("b", 8, 1)]
    assert out.scheduled[0].block_ids == [2, 3, 0]
    assert produced == [("b", 22)]

    assert not scheduler.has_unfinished_requests()
    assert b.status is RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [22, 22, 22]
    assert b.all_token_ids == prompt(7, 200) + [22, 22, 22]
    assert a.output_token_ids == [11, 11, 11]
    assert c.output_token_ids == [33]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 0)
    assert_all_blocks_free(pool)


def test_a_request_that_cannot_grow_preempts_itself(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=3, prefix_caching=False)
    a = make_request("a", prompt(4, 100), max_tokens=2)
    b = make_request("b", prompt(8, 200), max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    model = FakeModel()

    trace, out, _ = step(scheduler, model)
    assert trace == [("a", 0, 4), ("b", 0, 8)]
    assert [s.block_ids for s in out.scheduled] == [[0], [1, 2]]

    # a needs a second block: b (last admitted) goes. Then b itself is not scheduled.
    trace, out, _ = step(scheduler, model)
    assert out.preempted == ["b"]
    assert trace == [("a", 4, 1)]
    assert out.scheduled[0].block_ids == [0, 2]
    assert a.status is RequestStatus.FINISHED_LENGTH

    trace, out, produced = step(scheduler, model)
    assert trace == [("b", 0, 9)]  # the recompute samples b's second and last token
    assert out.scheduled[0].block_ids == [1, 2, 0]  # free list after a finished: [1] + a tail first [2, 0]
    assert produced == [("b", 7)]
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(pool)

    # One request alone whose next block does not exist: it preempts itself, and waits.
    scheduler, pool = make_scheduler(num_blocks=2, prefix_caching=False)
    lone = make_request("lone", prompt(8, 100), max_tokens=2)
    scheduler.add_request(lone)
    trace, out, _ = step(scheduler, model)
    assert trace == [("lone", 0, 8)]
    trace, out, _ = step(scheduler, model)
    assert out.preempted == ["lone"]
    assert trace == []
    assert lone.status is RequestStatus.PREEMPTED
    assert list(scheduler.waiting) == [lone]
    assert_all_blocks_free(pool)
    scheduler.abort_requests(["lone"])
    assert_all_blocks_free(pool)


def test_preempted_request_resumes_from_its_own_prefix_cache(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=5, prefix_caching=True)
    a = make_request("a", prompt(8, 100), max_tokens=3)
    b = make_request("b", prompt(11, 200), max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    model = FakeModel({"a": 11, "b": 22})

    trace, out, _ = step(scheduler, model)
    assert trace == [("a", 0, 8), ("b", 0, 11)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2, 3, 4]]
    assert pool.num_cached_blocks == 4  # a: 2 full blocks, b: 2 full blocks

    assert (scheduler.kv_cache.prefix_queries_tokens, scheduler.kv_cache.prefix_hits_tokens) == (19, 0)

    trace, out, _ = step(scheduler, model)
    assert out.preempted == ["b"]
    assert trace == [("a", 8, 1)]
    assert out.scheduled[0].block_ids == [0, 1, 4]  # b's partial tail block, uncached
    # A step that preempts admits nothing: no prefix lookup was even tried.
    assert (scheduler.kv_cache.prefix_queries_tokens, scheduler.kv_cache.prefix_hits_tokens) == (19, 0)
    assert pool.free_block_ids() == [3, 2]  # b's cached blocks, free but still cache

    # b (12 tokens) would hit both its blocks (reviving them) and need 1 more: 3 > 2 free. It waits.
    trace, out, _ = step(scheduler, model)
    assert trace == [("a", 9, 1)]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert pool.free_block_ids() == [3, 2, 4, 1, 0]

    pool.take_events()
    trace, out, _ = step(scheduler, model)
    assert trace == [("b", 8, 4)]  # 8 tokens served by its own cached blocks
    assert out.scheduled[0].block_ids == [2, 3, 4]
    assert b.num_cached_tokens == 0  # counted at first scheduling only
    trace, out, _ = step(scheduler, model)
    assert trace == [("b", 12, 1)]
    assert not scheduler.has_unfinished_requests()
    assert b.output_token_ids == [22, 22, 22]
    assert_all_blocks_free(pool)


# -- prefix cache ----------------------------------------------------------------------------------------------


def test_a_second_request_with_the_same_prompt_gets_prefix_hits(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler()
    model = FakeModel()
    a = make_request("a", prompt(12), max_tokens=2)
    scheduler.add_request(a)
    assert run(scheduler, model) == [[("a", 0, 12)], [("a", 12, 1)]]
    assert a.num_cached_tokens == 0
    assert pool.num_cached_blocks == 3
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 2, 1, 0]
    pool.take_events()

    b = make_request("b", prompt(12), max_tokens=2)
    scheduler.add_request(b)
    trace, out, _ = step(scheduler, model)
    # 3 blocks cached, but the last token must be computed: 2 blocks hit, block 2's tokens recomputed.
    assert trace == [("b", 8, 4)]
    assert out.scheduled[0].block_ids == [0, 1, 4]
    assert b.num_cached_tokens == 8
    assert scheduler.kv_cache.prefix_queries_tokens == 24
    assert scheduler.kv_cache.prefix_hits_tokens == 8
    # b's copy of block 2 duplicates a cached hash: it stays uncached, and no event is sent.
    assert pool.take_events() == []
    assert pool.get_cached_block(b.block_hashes[2]) is pool.blocks[2]

    trace, _, _ = step(scheduler, model)
    assert trace == [("b", 12, 1)]
    assert b.output_token_ids == a.output_token_ids == [7, 7]
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(pool)


def test_a_request_shares_the_blocks_of_a_running_one(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler()
    model = FakeModel()
    a = make_request("a", prompt(10), max_tokens=3)
    scheduler.add_request(a)
    assert step(scheduler, model)[0] == [("a", 0, 10)]

    b = make_request("b", prompt(9), max_tokens=2)
    scheduler.add_request(b)
    trace, out, _ = step(scheduler, model)
    assert trace == [("a", 10, 1), ("b", 8, 1)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1, 2], [0, 1, 3]]
    assert [blk.ref_cnt for blk in pool.blocks[:4]] == [2, 2, 1, 1]

    run(scheduler, model)
    assert_all_blocks_free(pool)


def test_identical_prompts_admitted_in_one_step_cache_once(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler()
    model = FakeModel()
    a = make_request("a", prompt(8), max_tokens=1)
    b = make_request("b", prompt(8), max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    trace, out, _ = step(scheduler, model)
    # Nothing is cache until computed, so b cannot hit a's blocks in the step that computes them.
    assert trace == [("a", 0, 8), ("b", 0, 8)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2, 3]]
    assert pool.take_events() == [BlockStored(block_hashes=tuple(a.block_hashes))]
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[0]
    assert [blk.block_hash for blk in pool.blocks[2:4]] == [None, None]
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(pool)


def test_eviction_events_follow_the_workload(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=3)
    model = FakeModel()
    a = make_request("a", prompt(8, 100), max_tokens=1)
    scheduler.add_request(a)
    run(scheduler, model)
    assert pool.take_events() == [BlockStored(block_hashes=tuple(a.block_hashes))]
    assert pool.free_block_ids() == [2, 1, 0]

    b = make_request("b", prompt(8, 200), max_tokens=1)
    scheduler.add_request(b)
    run(scheduler, model)
    assert pool.take_events() == [
        BlockRemoved(block_hashes=(a.block_hashes[1],)),  # block 2 was never cache; block 1 held a's tail
        BlockStored(block_hashes=tuple(b.block_hashes)),
    ]
    assert_all_blocks_free(pool)


def test_queued_prompt_tokens_count_what_prefill_has_left(assert_all_blocks_free: AllFree) -> None:
    """The autoscaling signal: a waiting prompt counts whole, a chunked prefill its rest, a decoding request 0."""
    scheduler, pool = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", prompt(10, 100), max_tokens=2))
    scheduler.add_request(make_request("b", prompt(3, 200), max_tokens=2))
    assert scheduler.num_queued_prompt_tokens == 13
    model = FakeModel()
    step(scheduler, model)  # a: 4 of 10 computed; b still waits
    assert scheduler.num_queued_prompt_tokens == 6 + 3
    step(scheduler, model)
    step(scheduler, model)  # a's prompt done (8 + 2), b's first 2 tokens
    assert scheduler.num_queued_prompt_tokens == 1
    run(scheduler, model)
    assert scheduler.num_queued_prompt_tokens == 0
    assert_all_blocks_free(pool)
