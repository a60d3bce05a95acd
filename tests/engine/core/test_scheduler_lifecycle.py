"""Scheduler on exact state: stops, finish and abort, request ids, and a long random workload."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine.core.request import Request, RequestStatus
from tests.engine.core.scheduler_harness import (
    AllFree,
    B,
    EOS,
    FakeModel,
    make_request,
    make_scheduler,
    prompt,
    run,
    step,
)

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
    produced = scheduler.update_from_output(out, {"b": [9]})  # the runtime had nothing for a
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
