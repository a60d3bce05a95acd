"""The priority policy (vLLM's --scheduling-policy priority) on exact state: the order requests start in, which
request a shortage preempts, a higher-priority arrival displacing the lowest running request, and every block back
at the end. FCFS runs the same workloads beside it where the two differ."""

from __future__ import annotations

import pytest

from engine.core.request import RequestStatus
from engine.core.scheduler import SchedulerConfig
from tests.engine.core.scheduler_harness import AllFree, FakeModel, make_request, make_scheduler, prompt, run, step


def test_the_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")


def test_waiting_requests_start_by_priority_then_arrival(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, first, priority in (("a", 100, 0), ("b", 200, -1), ("c", 300, -1), ("d", 400, 5), ("e", 500, 0)):
        scheduler.add_request(make_request(rid, prompt(4, first), max_tokens=2, priority=priority))
    assert [r.request_id for r in scheduler.waiting] == ["b", "c", "a", "e", "d"]
    traces = run(scheduler, FakeModel())
    starts = [rid for trace in traces for rid, start, _ in trace if start == 0]
    assert starts == ["b", "c", "a", "e", "d"]  # an equal priority never displaces a running request
    assert scheduler.num_preemptions == 0
    assert_all_blocks_free(pool)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_higher_priority_arrival_displaces_the_lowest_running_request(
    policy: str, assert_all_blocks_free: AllFree
) -> None:
    scheduler, pool = make_scheduler(max_num_seqs=2, policy=policy)
    a = make_request("a", prompt(4, 100), max_tokens=4, priority=1)
    b = make_request("b", prompt(4, 200), max_tokens=4, priority=2)
    for r in (a, b):
        scheduler.add_request(r)
    model = FakeModel({"a": 11, "b": 22, "c": 33})
    trace, _, _ = step(scheduler, model)
    assert trace == [("a", 0, 4), ("b", 0, 4)]

    c = make_request("c", prompt(4, 300), max_tokens=2, priority=0)
    scheduler.add_request(c)
    trace, out, produced = step(scheduler, model)
    if policy == "fcfs":  # the batch is full: c waits for a place
        assert (trace, out.preempted) == ([("a", 4, 1), ("b", 4, 1)], [])
        assert c.status is RequestStatus.WAITING
    else:  # b, the lowest, goes back to wait; c starts in its place, ahead of a, which it outranks too
        assert (trace, out.preempted) == ([("c", 0, 4), ("a", 4, 1)], ["b"])
        assert produced == [("c", 33), ("a", 11)]
        assert b.status is RequestStatus.PREEMPTED and b.output_token_ids == [22] and b.num_computed_tokens == 0
        assert scheduler.kv_cache.block_ids("b") == []
        assert list(scheduler.waiting) == [b] and scheduler.running == [c, a]  # the running list in rank order
        # c is ahead of a now; b (2) does not outrank a (1): it waits for a place, and resumes from its cached
        # prompt block once c has finished.
        trace, out, _ = step(scheduler, model)
        assert (trace, out.preempted) == ([("c", 4, 1), ("a", 5, 1)], [])
        trace, _, _ = step(scheduler, model)
        assert trace == [("a", 6, 1), ("b", 4, 1)]
    run(scheduler, model)
    assert (a.output_token_ids, b.output_token_ids, c.output_token_ids) == ([11] * 4, [22] * 4, [33] * 2)
    assert b.num_preemptions == (1 if policy == "priority" else 0)
    assert_all_blocks_free(pool)


def test_a_higher_priority_head_takes_the_blocks_of_a_lower_running_request(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=4, policy="priority", prefix_caching=False)
    a = make_request("a", prompt(12, 100), max_tokens=2, priority=5)
    scheduler.add_request(a)
    model = FakeModel({"a": 11, "h": 44})
    trace, _, _ = step(scheduler, model)
    assert trace == [("a", 0, 12)] and pool.num_free_blocks == 1

    h = make_request("h", prompt(8, 200), max_tokens=1, priority=0)  # needs 2 blocks; a's next token takes the last
    scheduler.add_request(h)
    trace, out, produced = step(scheduler, model)
    assert (trace, out.preempted, produced) == ([("h", 0, 8)], ["a"], [("h", 44)])
    assert h.status is RequestStatus.FINISHED_LENGTH
    trace, _, _ = step(scheduler, model)
    assert trace == [("a", 0, 13)]  # a recomputes its prompt and its token
    assert not scheduler.has_unfinished_requests()
    assert a.output_token_ids == [11, 11] and a.num_preemptions == 1
    assert_all_blocks_free(pool)


def test_an_equal_or_lower_priority_head_waits_for_blocks(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(num_blocks=4, policy="priority", prefix_caching=False)
    a = make_request("a", prompt(12, 100), max_tokens=2, priority=5)
    scheduler.add_request(a)
    model = FakeModel()
    step(scheduler, model)
    scheduler.add_request(make_request("h", prompt(8, 200), max_tokens=1, priority=5))
    trace, out, _ = step(scheduler, model)
    assert (trace, out.preempted) == ([("a", 12, 1)], [])
    assert scheduler.head_blocked and not scheduler.priority_preemption_due()
    run(scheduler, model)
    assert scheduler.num_preemptions == 0
    assert_all_blocks_free(pool)


@pytest.mark.parametrize(("policy", "expected"), [("priority", [("h", 0, 4), ("a", 8, 4)]), ("fcfs", [("a", 8, 8)])])
def test_a_higher_priority_head_gets_the_budget_before_a_lower_running_prompt(
    policy: str, expected: list, assert_all_blocks_free: AllFree
) -> None:
    """A long low-priority prompt being prefilled in chunks takes the whole token budget under fcfs; under
    priority the waiting request that outranks it is admitted first and the chunk gets what is left."""
    scheduler, pool = make_scheduler(max_num_batched_tokens=8, policy=policy)
    a = make_request("a", prompt(24, 100), max_tokens=2, priority=5)
    scheduler.add_request(a)
    model = FakeModel()
    trace, _, _ = step(scheduler, model)
    assert trace == [("a", 0, 8)]
    scheduler.add_request(make_request("h", prompt(4, 200), max_tokens=1, priority=0))
    trace, out, _ = step(scheduler, model)
    assert (trace, out.preempted) == (expected, [])
    run(scheduler, model)
    assert scheduler.num_preemptions == 0
    assert_all_blocks_free(pool)


@pytest.mark.parametrize(("policy", "victim"), [("priority", "a"), ("fcfs", "b")])
def test_a_shortage_preempts_the_lowest_priority_not_the_newest(
    policy: str, victim: str, assert_all_blocks_free: AllFree
) -> None:
    scheduler, pool = make_scheduler(num_blocks=4, max_num_seqs=2, policy=policy, prefix_caching=False)
    a = make_request("a", prompt(7, 100), max_tokens=3, priority=3)
    scheduler.add_request(a)
    model = FakeModel({"a": 11, "b": 22})
    step(scheduler, model)
    b = make_request("b", prompt(7, 200), max_tokens=3, priority=0)  # admitted after a
    scheduler.add_request(b)
    trace, _, _ = step(scheduler, model)
    assert sorted(trace) == [("a", 7, 1), ("b", 0, 7)] and pool.num_free_blocks == 0
    # a's 9th token needs a third block: the shortage preempts the lowest request (priority), or the newest (fcfs)
    _, out, _ = step(scheduler, model)
    assert out.preempted == [victim]
    run(scheduler, model)
    assert (a.output_token_ids, b.output_token_ids) == ([11] * 3, [22] * 3)
    assert_all_blocks_free(pool)


def test_a_preempted_request_goes_back_to_its_place_by_rank(assert_all_blocks_free: AllFree) -> None:
    scheduler, pool = make_scheduler(max_num_seqs=1, policy="priority")
    low = make_request("low", prompt(4, 100), max_tokens=3, priority=9)
    scheduler.add_request(low)
    model = FakeModel()
    step(scheduler, model)
    mid = make_request("mid", prompt(4, 200), max_tokens=1, priority=4)
    top = make_request("top", prompt(4, 300), max_tokens=1, priority=1)
    later_low = make_request("later-low", prompt(4, 400), max_tokens=1, priority=9)
    for r in (later_low, mid, top):
        scheduler.add_request(r)
    trace, out, _ = step(scheduler, model)
    assert (trace, out.preempted) == ([("top", 0, 4)], ["low"])
    # low arrived before later-low, whose priority it shares: it stands ahead of it
    assert [r.request_id for r in scheduler.waiting] == ["mid", "low", "later-low"]
    traces = run(scheduler, model)
    assert [trace[0][0] for trace in traces] == ["mid", "low", "low", "later-low"]
    assert scheduler.num_preemptions == 1
    assert_all_blocks_free(pool)


def test_a_step_in_flight_preempts_nothing_and_the_next_synchronous_one_does() -> None:
    """Async scheduling: the step after one in flight may not preempt (its blocks are in use), so
    `can_schedule_ahead` says no while a higher-priority head waits for the lowest running request's place."""
    scheduler, _ = make_scheduler(max_num_seqs=2, policy="priority")
    for rid, first, priority in (("a", 100, 1), ("b", 200, 2)):
        scheduler.add_request(make_request(rid, prompt(4, first), max_tokens=8, priority=priority))
    model = FakeModel()
    step(scheduler, model)
    in_flight = scheduler.schedule()
    assert scheduler.can_schedule_ahead(in_flight)
    scheduler.add_request(make_request("c", prompt(4, 300), max_tokens=2, priority=0))
    assert scheduler.priority_preemption_due() and not scheduler.can_schedule_ahead(in_flight)
    ahead = scheduler.schedule(in_flight=in_flight)
    assert ahead.preempted == [] and [s.request.request_id for s in ahead.scheduled] == ["a", "b"]
    scheduler.update_from_output(in_flight, model(in_flight))
    scheduler.update_from_output(ahead, model(ahead))
    out = scheduler.schedule()
    assert out.preempted == ["b"] and [s.request.request_id for s in out.scheduled] == ["c", "a"]


def test_a_committed_remote_prompt_queues_by_rank() -> None:
    """A decode worker's committed handoff joins the waiting queue at its place, not at the back."""
    scheduler, _ = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("running", prompt(4, 100), max_tokens=8, priority=0))
    step(scheduler, FakeModel())
    scheduler.add_request(make_request("low", prompt(4, 200), max_tokens=2, priority=7))
    remote = make_request("remote", prompt(6, 300), max_tokens=2, priority=3)
    assert scheduler.reserve_remote(remote)
    assert scheduler.commit_remote(remote, 9) is None
    assert [r.request_id for r in scheduler.waiting] == ["remote", "low"]


def test_a_reservation_takes_the_blocks_of_lower_running_requests_only_when_asked_and_enough(
    assert_all_blocks_free: AllFree,
) -> None:
    """A decode worker's reservation for a prompt computed elsewhere (between steps, `preempt=True`): running
    requests it outranks give their blocks up, lowest first, only as many as make room, and only if they can."""
    scheduler, pool = make_scheduler(num_blocks=6, max_num_seqs=4, policy="priority", prefix_caching=False)
    model = FakeModel()
    for rid, first, priority in (("p1", 100, 1), ("p5", 200, 5), ("p9", 300, 9)):
        scheduler.add_request(make_request(rid, prompt(7, first), max_tokens=2, priority=priority))
    step(scheduler, model)
    assert pool.num_free_blocks == 0 and [r.request_id for r in scheduler.running] == ["p1", "p5", "p9"]

    urgent = make_request("urgent", prompt(7, 400), max_tokens=2, priority=0)  # prompt + 1: 2 blocks
    assert not scheduler.reserve_remote(urgent)  # not asked to preempt
    too_big = make_request("too-big", prompt(19, 500), max_tokens=2, priority=4)  # 5 blocks; p5 and p9 hold 4
    assert not scheduler.reserve_remote(too_big, preempt=True) and scheduler.num_preemptions == 0
    assert scheduler.reserve_remote(urgent, preempt=True)
    assert [r.request_id for r in scheduler.waiting] == ["p9"] and scheduler.num_preemptions == 1
    assert scheduler.commit_remote(urgent, 9) is None
    run(scheduler, model)
    assert_all_blocks_free(pool)
