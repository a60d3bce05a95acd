"""Scheduler on exact state: tokens scheduled per request and step, block tables, preemption, prefix hits, stops.

A fake "model" stands in for the runtime: it returns a fixed token per request (or a scripted sequence) for every
request whose step reaches the end of its tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kv_transfer.block_hash import BlockHashNamespace
from kv_transfer.kv_events import BlockRemoved, BlockStored

AllFree = Callable[[BlockPool], None]

B = 4  # block size
EOS = 0
NS = BlockHashNamespace(model="test-model", block_size=B, kv_dtype="float16")

Trace = list[tuple[str, int, int]]  # (request id, start, num_new_tokens) per scheduled request, in order


class FakeModel:
    """Samples `tokens[request_id]` (default 7) for every request whose step reaches the end of its tokens; a
    scripted request emits its script in order, then the default."""

    def __init__(self, tokens: dict[str, int] | None = None, scripts: dict[str, list[int]] | None = None) -> None:
        self.tokens = tokens or {}
        self.scripts = {rid: list(s) for rid, s in (scripts or {}).items()}

    def __call__(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for item in out.scheduled:
            if item.samples:
                rid = item.request.request_id
                script = self.scripts.get(rid)
                sampled[rid] = script.pop(0) if script else self.tokens.get(rid, 7)
        return sampled


def make_scheduler(
    *,
    num_blocks: int = 16,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 8192,
    prefix_caching: bool = True,
) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, block_size=B, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
    )
    return Scheduler(config, kv), pool


def make_request(request_id: str, prompt: list[int], *, max_tokens: int = 4, **params: object) -> Request:
    sampling_params = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    sampling_params.validate()
    return Request(
        request_id, prompt, sampling_params, eos_token_ids=(EOS,), max_tokens=max_tokens, hash_namespace=NS
    )


def prompt(n: int, first: int = 100) -> list[int]:
    return list(range(first, first + n))


def check_ref_counts(scheduler: Scheduler, pool: BlockPool) -> None:
    """A block's ref count is the number of block tables holding it; only running requests hold blocks."""
    holders = [0] * pool.num_blocks
    for rid in scheduler.requests:
        for block_id in scheduler.kv_cache.block_ids(rid):
            holders[block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders
    for request in scheduler.waiting:
        assert scheduler.kv_cache.block_ids(request.request_id) == []


def step(scheduler: Scheduler, model: FakeModel) -> tuple[Trace, SchedulerOutput, list[tuple[str, int]]]:
    out = scheduler.schedule()
    assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
    trace = [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]
    produced = scheduler.update_from_output(out, model(out))
    check_ref_counts(scheduler, scheduler.kv_cache.pool)
    return trace, out, [(r.request_id, t) for r, t in produced]


def run(scheduler: Scheduler, model: FakeModel, max_steps: int = 1000) -> list[Trace]:
    traces = []
    while scheduler.has_unfinished_requests():
        assert len(traces) < max_steps, "workload did not finish"
        trace, _, _ = step(scheduler, model)
        traces.append(trace)
    return traces


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
    scheduler.update_from_output(out, {"a": 7})
    out = scheduler.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 4, 1, True),
        ("b", 2, 3, True),
    ]
    scheduler.update_from_output(out, {"a": 7, "b": 7})
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


# -- stops -----------------------------------------------------------------------------------------------------


@pytest.fixture
def run_one(assert_all_blocks_free: AllFree) -> Callable[..., Request]:
    """Run one request to its end on a fresh scheduler; check its blocks all came back."""

    def run_one(request: Request, model: FakeModel, **config: int) -> Request:
        scheduler, pool = make_scheduler(**config)  # type: ignore[arg-type]
        scheduler.add_request(request)
        run(scheduler, model)
        assert request.is_finished
        assert_all_blocks_free(pool)
        return request

    return run_one


RunOne = Callable[..., Request]


def test_eos_stops(run_one: RunOne) -> None:
    r = run_one(make_request("r", prompt(5), max_tokens=10), FakeModel(scripts={"r": [5, 6, EOS, 9]}))
    assert r.output_token_ids == [5, 6, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.status.finish_reason == "stop"
    assert r.stop_reason is None


def test_ignore_eos_runs_to_max_tokens(run_one: RunOne) -> None:
    r = run_one(
        make_request("r", prompt(5), max_tokens=4, ignore_eos=True), FakeModel(scripts={"r": [5, 6, EOS, 9]})
    )
    assert r.output_token_ids == [5, 6, EOS, 9]
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.stop_reason is None


def test_stop_token_ids_stop_and_are_reported(run_one: RunOne) -> None:
    r = run_one(
        make_request("r", prompt(5), max_tokens=10, stop_token_ids=[6, 8]), FakeModel(scripts={"r": [5, 6, 8]})
    )
    assert r.output_token_ids == [5, 6]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 6


def test_stop_token_ids_apply_with_ignore_eos(run_one: RunOne) -> None:
    r = run_one(
        make_request("r", prompt(5), max_tokens=10, ignore_eos=True, stop_token_ids=[8]),
        FakeModel(scripts={"r": [EOS, 8]}),
    )
    assert r.output_token_ids == [EOS, 8]
    assert r.stop_reason == 8


def test_min_tokens_delays_stopping(run_one: RunOne) -> None:
    r = run_one(
        make_request("r", prompt(5), max_tokens=10, min_tokens=4, stop_token_ids=[6]),
        FakeModel(scripts={"r": [EOS, 6, EOS, EOS, EOS]}),
    )
    # Tokens 1..3 are below min_tokens and do not stop; the 4th output token does.
    assert r.output_token_ids == [EOS, 6, EOS, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED

    r = run_one(
        make_request("r", prompt(5), max_tokens=10, min_tokens=2, stop_token_ids=[6]),
        FakeModel(scripts={"r": [6, 6]}),
    )
    assert r.output_token_ids == [6, 6]
    assert r.stop_reason == 6


def test_min_tokens_does_not_delay_length_stops(run_one: RunOne) -> None:
    r = run_one(
        make_request("r", prompt(5), max_tokens=3, min_tokens=3), FakeModel(scripts={"r": [EOS, EOS, 5]})
    )
    assert r.output_token_ids == [EOS, EOS, 5]
    assert r.status is RequestStatus.FINISHED_LENGTH

    r = run_one(make_request("r", prompt(5), max_tokens=10, min_tokens=8), FakeModel(), max_model_len=8)
    assert r.output_token_ids == [7, 7, 7]
    assert r.status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_stops_with_length(max_tokens: int, run_one: RunOne) -> None:
    r = run_one(make_request("r", prompt(5), max_tokens=max_tokens), FakeModel())
    assert r.output_token_ids == [7] * max_tokens
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.status.finish_reason == "length"


def test_max_model_len_stops_with_length(run_one: RunOne) -> None:
    r = run_one(make_request("r", prompt(7), max_tokens=16), FakeModel(), max_model_len=10)
    assert r.output_token_ids == [7, 7, 7]
    assert r.num_tokens == 10
    assert r.status is RequestStatus.FINISHED_LENGTH


# -- finish, abort, ids ----------------------------------------------------------------------------------------


def test_abort_frees_blocks_and_is_idempotent(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(max_num_seqs=1)
    a = make_request("a", prompt(6, 100), max_tokens=8)
    b = make_request("b", prompt(6, 200), max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    model = FakeModel()
    assert step(scheduler, model)[0] == [("a", 0, 6)]
    assert pool.num_used_blocks == 2

    got = scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert got is a
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert a.times.finished_s is not None
    assert scheduler.running == []
    assert scheduler.kv_cache.block_ids("a") == []
    assert pool.num_used_blocks == 0
    assert pool.free_block_ids()[-2:] == [1, 0]

    assert scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    scheduler.abort_requests(["a", "a", "no-such-request"])
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert_all_blocks_free(pool)

    # A waiting request (never scheduled) leaves the queue.
    scheduler.abort_requests(["b"])
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.num_waiting == 0
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().is_empty
    assert_all_blocks_free(pool)


def test_abort_between_schedule_and_update(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler()
    a = make_request("a", prompt(6, 100), max_tokens=3)
    b = make_request("b", prompt(6, 200), max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    scheduler.abort_requests(["a"])
    produced = scheduler.update_from_output(out, {"b": 9})  # the runtime had nothing for a
    assert [(r.request_id, t) for r, t in produced] == [("b", 9)]
    assert a.num_computed_tokens == 0
    assert a.output_token_ids == []
    assert b.num_computed_tokens == 6
    scheduler.abort_requests(["b"])
    assert_all_blocks_free(pool)


def test_abort_a_preempted_request(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=4, prefix_caching=False)
    scheduler.add_request(make_request("a", prompt(8, 100), max_tokens=3))
    scheduler.add_request(make_request("b", prompt(7, 200), max_tokens=3))
    model = FakeModel()
    step(scheduler, model)
    _, out, _ = step(scheduler, model)
    assert out.preempted == ["b"]
    scheduler.abort_requests(["b"])
    assert scheduler.num_waiting == 0
    assert scheduler.requests.keys() == {"a"}
    run(scheduler, model)
    assert_all_blocks_free(pool)


def test_finish_with_a_stop_string_from_the_caller(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler()
    a = make_request("a", prompt(6), max_tokens=8)
    scheduler.add_request(a)
    step(scheduler, FakeModel())
    a.stop_reason = "\n\n"
    assert scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED) is a
    assert a.status.finish_reason == "stop"
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(pool)


def test_duplicate_request_id_is_rejected(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler()
    a = make_request("a", prompt(6), max_tokens=1)
    scheduler.add_request(a)
    with pytest.raises(ValueError, match="'a'"):
        scheduler.add_request(make_request("a", prompt(3), max_tokens=1))
    assert list(scheduler.waiting) == [a]
    assert scheduler.requests == {"a": a}

    # Also while it runs; the id is free again once it finished.
    scheduler.schedule()
    assert a.status is RequestStatus.RUNNING
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", prompt(3), max_tokens=1))
    scheduler.abort_requests(["a"])
    again = make_request("a", prompt(3), max_tokens=1)
    scheduler.add_request(again)
    run(scheduler, FakeModel())
    assert again.output_token_ids == [7]
    assert_all_blocks_free(pool)


# -- a long mixed workload -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_finishes_every_request_and_returns_every_block(
    seed: int, prefix_caching: bool, assert_all_blocks_free: AllFree
) -> None:
    """Small pool and budget so chunking, prefix sharing and preemption all happen; exact outputs at the end."""
    rng = random.Random(seed)
    scheduler, pool = make_scheduler(
        num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16, prefix_caching=prefix_caching
    )
    shared = prompt(8, 500)  # a shared system prompt for half the requests
    requests: list[Request] = []
    tokens: dict[str, int] = {}
    for i in range(30):
        rid = f"r{i}"
        body = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 14))]
        requests.append(make_request(rid, (shared if i % 2 else []) + body, max_tokens=rng.randrange(1, 9)))
        tokens[rid] = 1000 + i
    model = FakeModel(tokens)

    pending = list(requests)
    num_steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        trace, out, _ = step(scheduler, model)
        num_steps += 1
        assert num_steps < 2000
        assert len(out.scheduled) <= 4
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            # The block table covers every token computed after this step.
            assert len(s.block_ids) * B >= s.start + s.num_new_tokens
            assert len(s.block_ids) == len(set(s.block_ids))

    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [tokens[r.request_id]] * r.max_tokens
    assert scheduler.kv_cache.num_requests == 0
    assert scheduler.num_preemptions > 0  # the pool is small enough for these seeds
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions
    if prefix_caching:
        assert scheduler.kv_cache.prefix_hits_tokens > 0
    assert_all_blocks_free(pool)
