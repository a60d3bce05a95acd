"""Priority scheduling on a real engine (the tiny checkpoint): `LLM(scheduling_policy="priority")` and vLLM's
`generate(..., priority=[...])` serve lower values first; a higher-priority arrival displaces a running request,
which recomputes and still gives the same greedy tokens; FCFS refuses a priority; every block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.request.sampling_params import SamplingParams
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_generate_serves_lower_priorities_first_with_the_same_tokens(tiny_model_dir: Path) -> None:
    from engine.llm import LLM

    reference = [o.token_ids for o in LLM(model=str(tiny_model_dir), **TINY_ENGINE).generate(PROMPTS[:4], GREEDY)]
    llm = LLM(model=str(tiny_model_dir), scheduling_policy="priority", **{**TINY_ENGINE, "max_num_seqs": 1})
    outputs = llm.generate(PROMPTS[:4], GREEDY, priority=[3, 0, 2, -1])
    assert [o.token_ids for o in outputs] == reference  # in input order, as without priorities
    ttft = [o.stats.ttft_s for o in outputs]
    assert sorted(range(4), key=ttft.__getitem__) == [3, 1, 2, 0]  # one at a time: lowest value first
    assert llm.engine.block_pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, priority=[0])


def test_fcfs_refuses_a_priority_before_queueing_anything(tiny_model_dir: Path) -> None:
    from engine.llm import LLM

    llm = LLM(model=str(tiny_model_dir), **TINY_ENGINE)
    with pytest.raises(ValueError, match="priority 1 needs --scheduling-policy priority; this engine schedules fcfs"):
        llm.generate(PROMPTS[:2], GREEDY, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[:1], GREEDY, priority=[0])[0].finish_reason == "length"  # 0 is every request's


def test_an_urgent_arrival_displaces_a_running_request_which_recomputes_exactly(tiny_model_dir: Path) -> None:
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

    reference = [o.token_ids for o in LLM(model=str(tiny_model_dir), **TINY_ENGINE).generate(PROMPTS[:3], GREEDY)]
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), scheduling_policy="priority",
                                    **{**TINY_ENGINE, "max_num_seqs": 2}))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, priority=1))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, priority=2))
    tokens: dict[str, list[int]] = {"a": [], "b": [], "urgent": []}
    stats = {}

    def drain() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                stats[out.request_id] = out.stats

    for _ in range(3):
        drain()
    engine.add_request("urgent", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    drain()
    assert engine.scheduler.num_preemptions == 1 and engine.scheduler.requests["b"].num_preemptions == 1
    while engine.has_unfinished_requests():
        drain()
    assert [tokens["a"], tokens["b"], tokens["urgent"]] == reference
    assert stats["urgent"].e2e_latency_s < stats["b"].e2e_latency_s and stats["b"].num_preemptions == 1
    assert engine.block_pool.num_used_blocks == 0


def test_a_reservation_preempts_after_reading_the_step_in_flight(tiny_model_dir: Path) -> None:
    """A decode worker's reservation may take a lower request's blocks between steps. With async scheduling the step
    in flight, which may still write the lower request's KV into them, is read first; its outputs come with the
    next step's, none lost: the preempted request recomputes and every request gets the tokens it gets unpreempted."""
    from engine.llm_engine import LLMEngine

    low = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, priority=5)
    prompts = {"a": list(range(10, 38)), "b": list(range(40, 68))}  # 28 + 20 tokens: 12 blocks each, 16 in the pool
    runs = {}
    for async_scheduling, reserve in ((False, False), (True, True), (False, True)):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), scheduling_policy="priority",
                                        async_scheduling=async_scheduling,
                                        **{**TINY_ENGINE, "num_kv_blocks": 16, "max_model_len": 64}))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        num_outputs = {"a": 0, "b": 0}  # one per token: the drained step's are not lost

        def collect(outs) -> None:  # type: ignore[no-untyped-def]
            for out in outs:
                tokens[out.request_id] = list(out.token_ids)
                num_outputs[out.request_id] += 1

        for name, prompt in prompts.items():
            engine.add_request(name, prompt, low)
        for _ in range(3):
            collect(engine.step())
        if reserve:
            urgent = engine.make_request("urgent", list(range(70, 98)),
                                         SamplingParams(temperature=0.0, max_tokens=2))
            assert engine.reserve_remote(urgent) is None  # the pool is full
            engine._stepping = True  # as a worker's call_now while a step computes: its requests are in use
            assert engine.reserve_remote(urgent, preempt=True) is None and engine.scheduler.num_preemptions == 0
            engine._stepping = False
            assert engine.reserve_remote(urgent, preempt=True) is not None
            assert engine.scheduler.num_preemptions == 1 and engine._in_flight is None
            engine.abort_request(["urgent"])  # its KV never comes
        while engine.has_unfinished_requests():
            collect(engine.step())
        engine.step()  # reads the last step in flight
        assert engine.block_pool.num_used_blocks == 0 and num_outputs == {"a": 20, "b": 20}
        runs[(async_scheduling, reserve)] = tokens
    reference = runs[(False, False)]
    assert all(len(t) == 20 for t in reference.values())
    assert runs[(True, True)] == runs[(False, True)] == reference


def test_freed_blocks_go_to_the_waiting_reservation_of_higher_priority(tiny_model_dir: Path) -> None:
    """Two handoff reservations find the pool full; when blocks free up, the lower one's ask comes first and is
    refused, so the higher one gets them; the lower one gets its blocks once the higher one has its own. A
    refused reservation whose worker stops asking is forgotten after the TTL."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), scheduling_policy="priority",
                                    **{**TINY_ENGINE, "num_kv_blocks": 16, "max_model_len": 64}))
    engine.add_request("a", list(range(10, 38)), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()  # 28 prompt tokens: 8 of the 16 blocks (7 for the prompt, 1 for its first token)
    high = engine.make_request("high", list(range(40, 68)), SamplingParams(temperature=0.0, max_tokens=2))
    low = engine.make_request("low", list(range(70, 98)),
                              SamplingParams(temperature=0.0, max_tokens=2, priority=3))
    filler = engine.make_request("filler", list(range(100, 104)), SamplingParams(temperature=0.0, max_tokens=2,
                                                                                  priority=9))
    assert engine.reserve_remote(filler) is not None  # 2 blocks: 6 left, short of the 8 each reservation needs
    assert engine.reserve_remote(low) is None and engine.reserve_remote(high) is None
    engine.abort_request(["filler"])  # 8 free now: enough for either
    assert engine.reserve_remote(low) is None  # it asks first, but high waits
    assert engine.reserve_remote(high) is not None
    engine.abort_request(["a"])
    assert engine.reserve_remote(low) is not None

    engine.abort_request(["high", "low"])
    clock = [0.0]
    engine._waiting_reservations._clock = lambda: clock[0]  # type: ignore[union-attr]
    filler = engine.make_request("filler", list(range(100, 104)), SamplingParams(temperature=0.0, max_tokens=2,
                                                                                  priority=9))
    assert engine.reserve_remote(filler) is not None  # 2 blocks: 14 left
    gone = engine.make_request("gone", list(range(0, 63)), SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.reserve_remote(gone) is None  # 16 blocks: more than are left; its worker then gives up
    later = engine.make_request("later", list(range(40, 44)), SamplingParams(temperature=0.0, max_tokens=2,
                                                                              priority=1))
    assert engine.reserve_remote(later) is None  # held back while "gone" may still ask
    clock[0] += 1.5
    assert engine.reserve_remote(later) is not None
    engine.abort_request(["filler", "later"])
    assert engine.block_pool.num_used_blocks == 0 and len(engine._waiting_reservations) == 0  # type: ignore[arg-type]
