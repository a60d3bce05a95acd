"""The scheduler's disaggregation side doors, on exact state: a prefill worker holds a prefilled request's
blocks until the handoff ends; a decode worker reserves blocks, commits received KV and decodes from there."""

from __future__ import annotations

from engine.core.request import RequestStatus
from tests.engine.core.scheduler_harness import B, EOS, FakeModel, check_ref_counts, make_request, make_scheduler, prompt, run, step


def remote_decode_request(request_id: str, n: int, **kw):
    req = make_request(request_id, prompt(n), **kw)
    req.remote_decode = True
    return req


def test_prefilled_request_holds_its_blocks_until_released() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    req = remote_decode_request("p", 9)  # 3 blocks of 4
    sched.add_request(req)
    trace, _, produced = step(sched, FakeModel())
    assert trace == [("p", 0, 9)] and produced == [("p", 7)]
    assert req.status is RequestStatus.PREFILLED and req.is_finished
    assert not sched.has_unfinished_requests() and sched.held == {"p": req}
    assert sched.kv_cache.block_ids("p") == [0, 1, 2]
    assert pool.num_free_blocks == 5
    assert sched.release_held("p") and not sched.release_held("p")
    assert pool.num_free_blocks == 8
    # the two full blocks stay as prefix cache after the release
    assert pool.get_cached_block(req.block_hashes[0]) is not None


def test_prefilled_request_that_stops_on_its_first_token_is_not_held() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    sched.add_request(remote_decode_request("p", 5))
    _, _, produced = step(sched, FakeModel(tokens={"p": EOS}))
    assert produced == [("p", EOS)]
    assert sched.held == {} and pool.num_free_blocks == 8


def test_abort_of_a_held_request_frees_its_blocks() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    sched.add_request(remote_decode_request("p", 6))
    step(sched, FakeModel())
    assert sched.finish_request("p", RequestStatus.FINISHED_ABORTED) is not None
    assert sched.held == {} and pool.num_free_blocks == 8


def test_reserve_commit_decode() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    req = make_request("d", prompt(8), max_tokens=3)
    assert sched.reserve_remote(req)
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.kv_cache.block_ids("d") == [0, 1]
    assert sched.has_unfinished_requests() and not sched.has_schedulable_requests()
    assert sched.schedule().is_empty  # nothing runs before the KV arrives
    check_ref_counts(sched, pool)

    assert sched.commit_remote(req, 50) is None
    assert req.num_computed_tokens == 8 and req.output_token_ids == [50]
    trace, _, produced = step(sched, FakeModel())
    # straight into decode: one token (the first output token) at position 8, one new block for it
    assert trace == [("d", 8, 1)] and produced == [("d", 7)]
    assert sched.kv_cache.block_ids("d") == [0, 1, 2]
    run(sched, FakeModel())
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [50, 7, 7]
    assert pool.num_free_blocks == 8


def test_reserve_fails_cleanly_when_the_pool_is_full() -> None:
    sched, pool = make_scheduler(num_blocks=2)
    assert not sched.reserve_remote(make_request("d", prompt(3 * B)))
    assert sched.requests == {} and pool.num_free_blocks == 2
    assert sched.kv_cache.block_ids("d") == []


def test_abort_while_waiting_for_remote_kv_frees_the_reservation() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    sched.reserve_remote(make_request("d", prompt(10)))
    assert pool.num_free_blocks == 5
    sched.finish_request("d", RequestStatus.FINISHED_ABORTED)
    assert pool.num_free_blocks == 8 and not sched.has_unfinished_requests()


def test_commit_of_a_first_token_that_reaches_max_tokens_finishes() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    req = make_request("d", prompt(5), max_tokens=1)
    sched.reserve_remote(req)
    assert sched.commit_remote(req, 9) is RequestStatus.FINISHED_LENGTH
    assert pool.num_free_blocks == 8


def test_preempted_remote_request_recomputes_locally() -> None:
    sched, pool = make_scheduler(num_blocks=4)
    remote = make_request("d", prompt(8), max_tokens=6)  # 2 blocks
    sched.reserve_remote(remote)
    sched.commit_remote(remote, 50)
    local = make_request("l", prompt(4, first=300), max_tokens=6)
    sched.add_request(local)
    run(sched, FakeModel())
    assert remote.num_preemptions + local.num_preemptions >= 1
    assert remote.output_token_ids[0] == 50 and len(remote.output_token_ids) == 6
    assert pool.num_free_blocks == 4
