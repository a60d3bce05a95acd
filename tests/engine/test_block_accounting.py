"""Every KV block a request takes goes back to the pool, exactly once, whichever way the request ends.

Exits covered: success, a stop string, abort (running, mid-prefill and still waiting), a failing model step,
an exception or KeyboardInterrupt escaping `LLM.generate`'s loop (a caller's timeout), preemption under a tiny
pool, and prefix-cache hits that share blocks between requests. Success, stop strings, abort and preemption run
with async scheduling too (a step launched before the last one is read: engine/core/overlap.py). `BlockRefCounter`
counts references taken (allocate, touch) and returned (free); `assert_no_blocks_held` checks the pool is all free
afterwards.
"""

from __future__ import annotations


import pytest

from engine import SamplingParams
from tests.engine.tiny_model import (
    PROMPTS,
    BlockRefCounter,
    assert_no_blocks_held,
    drain,
    finals,
    greedy,
    make_engine,
    num_tokens_to_reach,
    pick_stop_string,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _add_all(engine, prompts, params: SamplingParams, prefix: str = "r") -> list[str]:  # noqa: ANN001
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    return ids


@pytest.mark.parametrize(("enable_prefix_caching", "async_scheduling"), [(True, False), (False, False),
                                                                         (True, True)])
def test_success_returns_every_block(tiny_checkpoint, enable_prefix_caching: bool, async_scheduling: bool) -> None:
    engine = make_engine(tiny_checkpoint, enable_prefix_caching=enable_prefix_caching,
                         async_scheduling=async_scheduling)
    counter = BlockRefCounter(engine)
    prompts = [*PROMPTS, list(range(3, 40)), PROMPTS[0]]  # a 37-token prompt, and a repeat that may hit the cache
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens=3 + 4 * i))
    engine.step()
    assert engine.block_pool.num_used_blocks > 0

    out = finals(drain(engine))

    assert {r: (o.finish_reason, len(o.token_ids)) for r, o in out.items()} == {
        f"r{i}": ("length", 3 + 4 * i) for i in range(len(prompts))
    }
    assert_no_blocks_held(engine)
    counter.assert_balanced()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_string_finish_returns_every_block(tiny_checkpoint, async_scheduling: bool) -> None:
    reference = make_engine(tiny_checkpoint)
    reference.add_request("ref", PROMPTS[1], greedy(max_tokens=24))
    ref = finals(drain(reference))["ref"]
    stop = pick_stop_string(ref.text, start=8)
    engine = make_engine(tiny_checkpoint, async_scheduling=async_scheduling)
    counter = BlockRefCounter(engine)
    engine.add_request("stop", PROMPTS[1], greedy(max_tokens=24, stop=[stop]))
    engine.add_request("other", PROMPTS[2], greedy(max_tokens=24))

    out = finals(drain(engine))

    assert (out["stop"].finish_reason, out["stop"].stop_reason) == ("stop", stop)
    assert len(out["stop"].token_ids) == num_tokens_to_reach(engine.tokenizer, ref.token_ids, stop) < 24
    assert out["other"].finish_reason == "length"
    assert_no_blocks_held(engine)
    counter.assert_balanced()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_mid_generation_returns_the_request_blocks_at_once(tiny_checkpoint, async_scheduling: bool) -> None:
    tiny_engine = make_engine(tiny_checkpoint, async_scheduling=async_scheduling)
    counter = BlockRefCounter(tiny_engine)
    _add_all(tiny_engine, PROMPTS[:3], greedy(max_tokens=30))
    for _ in range(3):
        tiny_engine.step()
    table = tiny_engine.kv_cache.block_ids("r1")
    num_used = tiny_engine.block_pool.num_used_blocks
    assert table

    (aborted,) = tiny_engine.abort_request(["r1"])

    assert (aborted.request_id, aborted.finished, aborted.finish_reason) == ("r1", True, "abort")
    # Async: the third step is in flight, its token for r1 never read (and never streamed: drained below).
    assert len(aborted.token_ids) == 3 - async_scheduling and aborted.error is None
    assert tiny_engine.block_pool.num_used_blocks == num_used - len(table)
    assert tiny_engine.kv_cache.block_ids("r1") == []
    assert tiny_engine.abort_request(["r1", "never-added"]) == []  # aborting twice, or an unknown id: a no-op
    rest_outputs = drain(tiny_engine)
    rest = finals(rest_outputs)
    assert "r1" not in rest_outputs
    assert sorted(rest) == ["r0", "r2"] and all(o.finish_reason == "length" for o in rest.values())
    assert_no_blocks_held(tiny_engine)
    counter.assert_balanced()


def test_abort_mid_prefill_and_while_waiting(tiny_checkpoint) -> None:
    # A 6-token budget chunks the 37-token prompt over several steps; one running slot keeps the other waiting.
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=6, max_num_seqs=1)
    counter = BlockRefCounter(engine)
    engine.add_request("long", list(range(3, 40)), greedy())
    engine.add_request("waiting", PROMPTS[0], greedy())
    engine.step()
    engine.step()
    assert engine.block_pool.num_used_blocks == 3  # 12 of 37 prompt tokens computed, in 4-token blocks
    assert engine.kv_cache.block_ids("waiting") == []

    out = {o.request_id: o for o in engine.abort_request(["waiting", "long"])}

    assert {r: (o.finish_reason, o.token_ids) for r, o in out.items()} == {
        "waiting": ("abort", []),
        "long": ("abort", []),
    }
    assert_no_blocks_held(engine)
    counter.assert_balanced()
    assert [s.finish_reason for s in engine.stats().finished] == ["abort", "abort"]


@pytest.mark.parametrize("failing_call", [1, 3])
def test_failing_step_errors_its_requests_frees_their_blocks_and_serving_goes_on(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, failing_call: int
) -> None:
    reference = make_engine(tiny_checkpoint)
    reference.add_request("after", PROMPTS[3], greedy())
    expected_after = finals(drain(reference))["after"].token_ids

    engine = make_engine(tiny_checkpoint, max_num_seqs=2)
    counter = BlockRefCounter(engine)
    launch = engine.runner.launch
    num_calls = 0

    def execute_failing_once(scheduled):  # noqa: ANN001, ANN202
        nonlocal num_calls
        num_calls += 1
        if num_calls == failing_call:
            raise RuntimeError("injected device fault")
        return launch(scheduled)

    monkeypatch.setattr(engine.runner, "launch", execute_failing_once)
    _add_all(engine, PROMPTS[:3], greedy())  # r2 waits for a running slot, outside the failing step
    for _ in range(failing_call - 1):
        engine.step()

    failed = engine.step()

    assert sorted(o.request_id for o in failed) == ["r0", "r1"]
    for out in failed:
        assert out.finished and out.finish_reason == "error"
        assert out.error is not None and "injected device fault" in out.error
        assert out.stats is not None and out.stats.finish_reason == "error"
        assert len(out.token_ids) == failing_call - 1
    assert engine.kv_cache.block_ids("r0") == engine.kv_cache.block_ids("r1") == []
    engine.add_request("after", PROMPTS[3], greedy())
    rest = finals(drain(engine))
    assert sorted(rest) == ["after", "r2"]
    assert rest["r2"].finish_reason == "length" and rest["after"].finish_reason == "length"
    assert rest["after"].token_ids == expected_after  # the failed step left nothing behind that changes results
    assert_no_blocks_held(engine)
    counter.assert_balanced()



@pytest.mark.parametrize("exc_type", [TimeoutError, KeyboardInterrupt])
def test_exception_escaping_generate_aborts_the_rest(tiny_llm, monkeypatch: pytest.MonkeyPatch, exc_type) -> None:
    # What a caller's deadline (a signal handler raising TimeoutError) or Ctrl-C looks like from inside the loop.
    engine = tiny_llm.engine
    counter = BlockRefCounter(engine)
    step = engine.step
    num_steps = 0

    def step_with_deadline():  # noqa: ANN202
        nonlocal num_steps
        num_steps += 1
        if num_steps == 4:
            raise exc_type("deadline")
        return step()

    monkeypatch.setattr(engine, "step", step_with_deadline)
    params = [greedy(max_tokens=2), greedy(max_tokens=20), greedy(max_tokens=20)]

    with pytest.raises(exc_type):
        tiny_llm.generate(PROMPTS[:3], params)

    assert_no_blocks_held(engine)
    counter.assert_balanced()
    finished = {s.request_id: s.finish_reason for s in engine.stats().finished}
    assert sorted(finished.values()) == ["abort", "abort", "length"]  # the short one finished before the deadline
    monkeypatch.setattr(engine, "step", step)
    outs = tiny_llm.generate(PROMPTS[:3], greedy(max_tokens=5))
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert_no_blocks_held(engine)


def test_keyboard_interrupt_inside_the_model_step_aborts_everything(
    tiny_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A BaseException is not an engine error: it passes through step() with blocks allocated for that step.
    engine = tiny_llm.engine
    counter = BlockRefCounter(engine)
    launch = engine.runner.launch
    num_calls = 0

    def execute_interrupted(scheduled):  # noqa: ANN001, ANN202
        nonlocal num_calls
        num_calls += 1
        if num_calls == 2:
            raise KeyboardInterrupt
        return launch(scheduled)

    monkeypatch.setattr(engine.runner, "launch", execute_interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny_llm.generate(PROMPTS, greedy(max_tokens=10))

    assert_no_blocks_held(engine)
    counter.assert_balanced()
    assert [s.finish_reason for s in engine.stats().finished] == ["abort"] * len(PROMPTS)


PREEMPTION_PROMPTS = [*PROMPTS, list(range(40, 60)), list(range(100, 112))]


def _mixed_params() -> list[SamplingParams]:
    """Greedy and seeded-random requests: both must come out the same whether or not they were preempted."""
    return [
        greedy(max_tokens=16) if i % 2 == 0 else SamplingParams(temperature=0.9, seed=100 + i, max_tokens=16,
                                                                   ignore_eos=True)
        for i in range(len(PREEMPTION_PROMPTS))
    ]


@pytest.mark.parametrize(("max_num_batched_tokens", "async_scheduling"), [(256, False), (6, False), (256, True),
                                                                          (6, True)])
def test_preemption_heavy_workload_returns_every_block(tiny_checkpoint, max_num_batched_tokens: int,
                                                       async_scheduling: bool) -> None:
    settings = dict(max_model_len=48, max_num_batched_tokens=max_num_batched_tokens)
    reference = make_engine(tiny_checkpoint, **settings)
    for i, (prompt, params) in enumerate(zip(PREEMPTION_PROMPTS, _mixed_params(), strict=True)):
        reference.add_request(f"r{i}", prompt, params)
    expected = {r: o.token_ids for r, o in finals(drain(reference)).items()}
    assert reference.scheduler.num_preemptions == 0

    # 12 blocks of 4 tokens hold one 48-token request; six requests growing to ~30 tokens each do not fit.
    engine = make_engine(tiny_checkpoint, num_kv_blocks=12, async_scheduling=async_scheduling, **settings)
    counter = BlockRefCounter(engine)
    for i, (prompt, params) in enumerate(zip(PREEMPTION_PROMPTS, _mixed_params(), strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    out = finals(drain(engine))

    stats = engine.stats()
    assert stats.num_preemptions == engine.scheduler.num_preemptions > 0
    assert sum(s.num_preemptions for s in stats.finished) == stats.num_preemptions
    assert {r: o.finish_reason for r, o in out.items()} == {r: "length" for r in expected}
    assert {r: o.token_ids for r, o in out.items()} == expected
    assert_no_blocks_held(engine)
    counter.assert_balanced()


def test_prefix_cache_hit_on_a_repeated_prompt(tiny_engine) -> None:
    prompt = list(range(10, 32))  # 22 tokens: 5 full blocks, of which 5 may hit (one token is always recomputed)
    tiny_engine.add_request("first", prompt, greedy())
    first = finals(drain(tiny_engine))["first"]
    before = tiny_engine.stats()

    tiny_engine.add_request("second", prompt, greedy())
    second = finals(drain(tiny_engine))["second"]
    after = tiny_engine.stats()

    assert [s.num_cached_tokens for s in before.finished] == [0]
    assert [s.num_cached_tokens for s in after.finished] == [20]
    assert second.stats is not None and second.stats.num_cached_tokens == 20
    assert after.prefix_cache_queries - before.prefix_cache_queries == 22
    assert after.prefix_cache_hits - before.prefix_cache_hits == 20
    assert second.token_ids == first.token_ids
    assert_no_blocks_held(tiny_engine)
    # vLLM's reset_prefix_cache: refused while a request holds blocks, then the next turn computes it all
    tiny_engine.add_request("running", prompt, greedy())
    tiny_engine.step()
    assert not tiny_engine.reset_prefix_cache() and tiny_engine.block_pool.cached_block_hashes()
    drain(tiny_engine)
    assert tiny_engine.reset_prefix_cache() and not tiny_engine.block_pool.cached_block_hashes()
    tiny_engine.add_request("cold", prompt, greedy())
    cold = finals(drain(tiny_engine))["cold"]
    assert cold.stats is not None and cold.stats.num_cached_tokens == 0 and cold.token_ids == first.token_ids
    assert_no_blocks_held(tiny_engine)


def test_blocks_shared_by_prefix_hits_are_freed_once_per_reference(tiny_engine) -> None:
    counter = BlockRefCounter(tiny_engine)
    prompt = list(range(10, 32))
    tiny_engine.add_request("a", prompt, greedy(max_tokens=12))
    tiny_engine.step()  # "a"'s prompt blocks are computed and cached
    tiny_engine.add_request("b", prompt, greedy(max_tokens=12))
    tiny_engine.add_request("c", [*prompt[:16], 99, 98], greedy(max_tokens=12))
    tiny_engine.step()
    shared = set(tiny_engine.kv_cache.block_ids("a")[:4])
    assert shared <= set(tiny_engine.kv_cache.block_ids("b")) and shared <= set(tiny_engine.kv_cache.block_ids("c"))
    assert all(tiny_engine.block_pool.blocks[b].ref_cnt == 3 for b in shared)

    tiny_engine.abort_request(["a"])
    assert all(tiny_engine.block_pool.blocks[b].ref_cnt == 2 for b in shared)
    out = finals(drain(tiny_engine))

    assert {r: o.finish_reason for r, o in out.items()} == {"b": "length", "c": "length"}
    assert out["b"].stats is not None and out["b"].stats.num_cached_tokens == 20
    assert out["c"].stats is not None and out["c"].stats.num_cached_tokens == 16
    assert_no_blocks_held(tiny_engine)
    counter.assert_balanced()
