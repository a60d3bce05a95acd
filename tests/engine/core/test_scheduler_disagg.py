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
    assert sched.kv_cache.block_ids("d") == [0, 1, 2]  # the prompt's 8 tokens and the first token it decodes
    assert sched.has_unfinished_requests() and not sched.has_schedulable_requests()
    assert sched.schedule().is_empty  # nothing runs before the KV arrives
    check_ref_counts(sched, pool)

    assert sched.commit_remote(req, 50) is None
    assert req.num_computed_tokens == 8 and req.output_token_ids == [50]
    trace, _, produced = step(sched, FakeModel())
    # straight into decode: one token (the first output token) at position 8, in the block reserved for it
    assert trace == [("d", 8, 1)] and produced == [("d", 7)]
    assert sched.kv_cache.block_ids("d") == [0, 1, 2]
    run(sched, FakeModel())
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [50, 7, 7]
    assert pool.num_free_blocks == 8


def test_reserve_shares_the_prompts_prefix_already_cached_here() -> None:
    """A decode worker that holds the head of a prompt (an earlier turn, say) reserves only the rest: the held
    blocks are shared, are not counted as a prefix-cache query (nothing is computed here), and go back to the
    cache, not the free list, when the request ends."""
    sched, pool = make_scheduler(num_blocks=8)
    first = make_request("a", prompt(9), max_tokens=1)  # blocks 0, 1 full and cached once computed
    sched.add_request(first)
    run(sched, FakeModel())
    queries = sched.kv_cache.prefix_queries_tokens
    hits = sched.kv_cache.prefix_hits_tokens

    req = make_request("d", prompt(13), max_tokens=2)  # the same first 9 tokens, then 4 more
    assert sched.reserve_remote(req)
    assert sched.kv_cache.num_cached_blocks("d") == 2
    table = sched.kv_cache.block_ids("d")
    assert table[:2] == [pool.get_cached_block(h).block_id for h in req.block_hashes[:2]]
    assert len(table) == 4  # 13 prompt tokens + the first output token: 2 shared + 2 new
    assert (sched.kv_cache.prefix_queries_tokens, sched.kv_cache.prefix_hits_tokens) == (queries, hits)
    check_ref_counts(sched, pool)

    assert sched.commit_remote(req, 50) is None
    run(sched, FakeModel())
    assert req.status is RequestStatus.FINISHED_LENGTH and pool.num_free_blocks == 8
    assert pool.get_cached_block(req.block_hashes[2]) is not None  # its own full block, cached at commit


def test_abort_of_a_reservation_that_shares_a_cached_prefix_frees_only_its_own_blocks() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", prompt(9), max_tokens=1))
    run(sched, FakeModel())
    req = make_request("d", prompt(13))
    assert sched.reserve_remote(req) and sched.kv_cache.num_cached_blocks("d") == 2
    sched.abort_requests(["d"])
    assert pool.num_free_blocks == 8 and pool.get_cached_block(req.block_hashes[1]) is not None
    check_ref_counts(sched, pool)


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


def _reserve_and_commit(sched, request_id: str, n: int, *, max_tokens: int, first_token: int = 50):  # type: ignore[no-untyped-def]
    req = make_request(request_id, prompt(n, first=100 * (ord(request_id[0]) - 96)), max_tokens=max_tokens)
    assert sched.reserve_remote(req)
    assert sched.commit_remote(req, first_token) is None
    return req


def test_two_remote_prompts_on_a_full_pool_both_finish() -> None:
    """The deadlock of issue 15: two 16-token prompts, 8 blocks of 4. Each reservation takes prompt + 1 = 5 blocks,
    so the second waits until the first is done, and both finish with every block free."""
    sched, pool = make_scheduler(num_blocks=8)
    first = _reserve_and_commit(sched, "a", 16, max_tokens=4)
    assert sched.kv_cache.block_ids("a") == [0, 1, 2, 3, 4]
    second = make_request("b", prompt(16, first=200), max_tokens=4)
    assert not sched.reserve_remote(second)  # 3 free blocks < 5: the decode worker waits and retries
    assert sched.requests.keys() == {"a"} and pool.num_free_blocks == 3
    steps = 0
    while sched.has_schedulable_requests():
        trace, _, _ = step(sched, FakeModel())
        assert trace, "a step with schedulable requests scheduled nothing"
        steps += 1
    assert first.status is RequestStatus.FINISHED_LENGTH and first.output_token_ids == [50, 7, 7, 7]
    assert steps == 3 and pool.num_free_blocks == 8
    _reserve_and_commit(sched, "b", 16, max_tokens=4)
    run(sched, FakeModel())
    assert pool.num_free_blocks == 8 and not sched.has_unfinished_requests()
    check_ref_counts(sched, pool)


def test_a_committed_request_waiting_behind_a_blocked_head_gives_its_blocks_up() -> None:
    """Nothing runs; the head of the waiting queue (a preempted request to recompute) needs more blocks than are
    free, and a committed remote request behind it holds them: that one is preempted (it recomputes later) and
    the head goes first, then the other, and both finish."""
    sched, pool = make_scheduler(num_blocks=6)
    local = make_request("l", prompt(16, first=300), max_tokens=6)  # 16 + 6 tokens: up to 6 blocks
    sched.add_request(local)
    step(sched, FakeModel())  # prefilled: 4 blocks, and its first token
    remote = _reserve_and_commit(sched, "r", 4, max_tokens=3)  # 2 blocks: the pool is full
    assert pool.num_free_blocks == 0
    # the running request needs a 5th block: it preempts itself (the only running one), and then the head (it)
    # cannot get 5 blocks while the committed request behind it holds 2
    trace, _, _ = step(sched, FakeModel())
    assert local.status is RequestStatus.PREEMPTED and local.num_preemptions == 1 and trace == []
    trace, _, _ = step(sched, FakeModel())
    assert remote.num_preemptions == 1 and not remote.kv_in_place  # gave its blocks up for the head
    assert trace and trace[0][0] == "l"  # the head recomputes its tokens first
    run(sched, FakeModel())
    assert local.status is RequestStatus.FINISHED_LENGTH and len(local.output_token_ids) == 6
    assert remote.status is RequestStatus.FINISHED_LENGTH and remote.output_token_ids == [50, 7, 7]
    assert pool.num_free_blocks == 6
    check_ref_counts(sched, pool)


def test_no_reservation_while_the_head_of_the_queue_is_blocked() -> None:
    sched, pool = make_scheduler(num_blocks=6)
    hog = _reserve_and_commit(sched, "h", 8, max_tokens=2)  # 3 blocks
    held = make_request("x", prompt(8, first=400), max_tokens=2)
    assert sched.reserve_remote(held)  # 3 blocks, still waiting for its KV: the pool is full
    local = make_request("l", prompt(6, first=300), max_tokens=2)
    sched.add_request(local)
    step(sched, FakeModel())  # the committed hog runs; the local request cannot get 2 blocks
    assert sched.head_blocked and sched.waiting[0] is local
    assert not sched.reserve_remote(make_request("y", prompt(2, first=500), max_tokens=2))  # it goes first
    run_until = 0
    while hog.status is not RequestStatus.FINISHED_LENGTH and run_until < 10:
        step(sched, FakeModel())
        run_until += 1
    sched.finish_request("x", RequestStatus.FINISHED_ABORTED)
    run(sched, FakeModel())
    assert local.status is RequestStatus.FINISHED_LENGTH and pool.num_free_blocks == 6
