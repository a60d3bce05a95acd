"""EngineLoop: an engine whose step can schedule nothing sleeps instead of spinning, and moves again at once when
a command frees the way; its heartbeat says how long the running step has been running."""

from __future__ import annotations

import threading
import time

import pytest

from engine.request.sampling_params import SamplingParams
from tests.engine.tiny_model import assert_no_blocks_held, make_engine
from worker.engine_loop import EngineLoop, EngineLoopClosed


def test_a_loop_that_can_schedule_nothing_sleeps_and_wakes_on_a_command(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint)  # 64 blocks of 4 tokens
    params = SamplingParams(max_tokens=2, temperature=0.0)
    # Two reservations of 100-token prompts whose KV never arrives hold 2 x 26 blocks; a local 60-token prompt
    # then needs 15 of the 12 left: it waits, nothing runs, and only an abort can change that.
    for name in ("r1", "r2"):
        assert engine.reserve_remote(engine.make_request(name, list(range(1, 101)), params)) is not None
    engine.add_request("local", list(range(1, 61)), params)
    assert engine.block_pool.num_free_blocks == 12

    num_steps = 0
    step = engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        nonlocal num_steps
        num_steps += 1
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    loop = EngineLoop(engine, name="test-loop")
    finished = threading.Event()
    loop.listen("local", lambda out: finished.set() if out.finished else None)
    loop.start()
    try:
        time.sleep(0.5)
        assert num_steps < 20, f"{num_steps} steps in 0.5 s: the loop spins"
        assert not finished.is_set() and engine.num_scheduled_last_step == 0
        assert loop.step_running_s() == 0.0  # between steps, not stuck in one
        started = time.monotonic()
        loop.call(lambda e: e.abort_request(["r1"]))  # frees 26 blocks: the local request can run now
        assert finished.wait(10.0)
        assert time.monotonic() - started < 5.0
        loop.call(lambda e: e.abort_request(["r2"]))
        assert loop.call(lambda e: e.block_pool.num_used_blocks) == 0
    finally:
        loop.stop()


def test_the_heartbeat_shows_a_step_that_runs_long(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint)
    step = engine.step
    in_step = threading.Event()

    def slow_step():  # type: ignore[no-untyped-def]
        in_step.set()
        time.sleep(0.6)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    loop = EngineLoop(engine, name="test-loop")
    loop.start()
    try:
        loop.call(lambda e: e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1)))
        assert in_step.wait(5.0)
        time.sleep(0.3)
        assert 0.2 < loop.step_running_s() < 0.7
    finally:
        loop.stop()


def test_stopping_the_loop_aborts_every_request_the_held_ones_included(tiny_checkpoint) -> None:
    """A worker stopping: a request whose KV is being handed off (held after its prefill), a reservation whose KV
    never came and a decoding request all end, and every block goes back."""
    engine = make_engine(tiny_checkpoint)  # 64 blocks of 4 tokens, max_model_len 128
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    engine.enqueue(engine.make_request("held", list(range(1, 30)), params, remote_decode=True))
    engine.add_request("decoding", list(range(1, 20)), params)
    engine.step()  # both prompts computed: "held" keeps its 8 blocks for the handoff, "decoding" goes on
    assert len(engine.held_block_ids("held")) == 8
    assert engine.reserve_remote(engine.make_request("reserved", list(range(40, 60)), params)) is not None
    loop = EngineLoop(engine, name="test-loop")
    loop.start()
    loop.stop()
    assert_no_blocks_held(engine)
    assert not engine.scheduler.held


def test_with_async_scheduling_listeners_get_the_same_outputs_in_order(tiny_checkpoint) -> None:
    """The loop runs commands (here: adds) between steps while a step is in flight; each listener gets what it
    gets without async scheduling, in order, and the engine ends with every block back."""
    from tests.engine.tiny_model import PROMPTS

    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=4, ignore_eos=True, stop=["e"])]
    streams = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_checkpoint, async_scheduling=async_scheduling)
        loop = EngineLoop(engine, name="test-loop")
        got: dict[str, list] = {}
        done = threading.Semaphore(0)

        def listener(out, got=got, done=done):  # type: ignore[no-untyped-def]
            got.setdefault(out.request_id, []).append((out.new_token_ids, out.delta_text, out.finish_reason))
            if out.finished:
                done.release()

        loop.start()
        try:
            for i, prompt in enumerate(PROMPTS):
                loop.listen(f"r{i}", listener)
                loop.call(lambda e, i=i, prompt=prompt: e.add_request(f"r{i}", prompt, params[i % 2]))
            for _ in PROMPTS:
                assert done.acquire(timeout=30)
            assert loop.call(lambda e: e.block_pool.num_used_blocks) == 0
        finally:
            loop.stop()
        streams[async_scheduling] = got
        assert_no_blocks_held(engine)
    assert streams[True] == streams[False]


def test_a_commands_outputs_reach_the_listeners_before_its_caller_hears_it_ran(tiny_checkpoint) -> None:
    """The decode worker lets go of a failed attempt (unlisten, abort, await the abort) before the gateway's retry
    of the same request id listens. The abort's final output must be handed out before the abort's future resolves:
    were it handed out after, a retry listening in between would get the failed attempt's "abort" and end at once
    (a 503 on a busy 2-core CI machine)."""
    engine = make_engine(tiny_checkpoint)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    loop = EngineLoop(engine, name="test-loop")
    first_attempt: list = []
    retry: list = []
    loop.listen("a", first_attempt.append)
    gate = threading.Event()
    loop.start()
    try:
        loop.call(lambda e: e.add_request("a", [1, 2, 3], params))
        held = loop.submit(lambda e: gate.wait(10.0))  # the engine thread waits here, so the abort queues behind
        aborted = loop.submit(lambda e: e.abort_request(["a"]))
        heard = {}

        def on_done(_future) -> None:  # type: ignore[no-untyped-def]  # runs as the future resolves
            heard["first attempt finished"] = any(out.finished for out in first_attempt)
            loop.listen("a", retry.append)  # the retry, listening the moment the abort is known done

        aborted.add_done_callback(on_done)
        gate.set()
        held.result(10.0)
        assert [out.finished for out in aborted.result(10.0)] == [True]
        assert heard == {"first attempt finished": True}
        assert not retry, "the retry was handed the aborted attempt's output"
        assert loop.call(lambda e: e.block_pool.num_used_blocks) == 0
    finally:
        loop.stop()
    assert_no_blocks_held(engine)


def test_call_now_runs_while_a_step_computes_and_waits_for_a_command(tiny_checkpoint) -> None:
    """`call_now` (a peer's pin of cached blocks) takes the engine's lock while a step's forward runs, without
    waiting for the step to end: here the forward itself waits for the call, which a loop holding the lock through
    the whole step would not let run. A command holds the lock throughout: `call_now` waits for it to end."""
    engine = make_engine(tiny_checkpoint)
    model = engine.runner.model
    forward = model.forward
    in_forward, called = threading.Event(), threading.Event()
    saw_the_call: list[bool] = []

    def waiting_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not saw_the_call:  # the first forward only
            in_forward.set()
            saw_the_call.append(called.wait(5.0))
        return forward(*args, **kwargs)

    model.forward = waiting_forward
    loop = EngineLoop(engine, name="test-loop")
    finished = threading.Event()
    loop.listen("a", lambda out: finished.set() if out.finished else None)
    loop.start()
    try:
        loop.call(lambda e: e.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=3, temperature=0.0)))
        assert in_forward.wait(10.0)
        started = time.monotonic()
        assert loop.call_now(lambda e: e.block_pool.num_used_blocks) > 0  # the prompt's blocks, allocated
        called.set()
        assert time.monotonic() - started < 2.0
        assert finished.wait(10.0)
        assert saw_the_call == [True]

        gate, in_command, done = threading.Event(), threading.Event(), threading.Event()
        held = loop.submit(lambda e: (in_command.set(), gate.wait(10.0)))
        assert in_command.wait(5.0)
        threading.Thread(target=lambda: (loop.call_now(lambda e: None), done.set()), daemon=True).start()
        assert not done.wait(0.3), "call_now ran while a command held the engine"
        gate.set()
        assert done.wait(5.0)
        held.result(5.0)
        assert loop.call(lambda e: e.block_pool.num_used_blocks) == 0
    finally:
        loop.stop()
    assert_no_blocks_held(engine)
    with pytest.raises(EngineLoopClosed):
        loop.call_now(lambda e: None)
