"""Async scheduling (`--async-scheduling`, engine/core/overlap.py): the engine launches step N+1 before it reads
step N, and gives what it gives without.

- Every request's stream of outputs is the same with and without (tokens, text, logprobs, finish reasons): greedy,
  seeded random, logprobs, stop strings and stop token ids, max_tokens, penalties and min_tokens (which read the
  last token on the host: those steps run synchronously), n > 1 (a grammar: tests/engine/structured/
  test_structured_real.py). Steps really overlapped: requests took their input token from the step in flight.
- A request whose token in step N ends it (a stop token id) already ran in step N+1: that token is discarded,
  never streamed, and its blocks come back.
- A prefill engine hands a prompt's KV to a decode engine, both async: the decode engine's tokens are the
  colocated engine's.
- The scheduler's side: which steps may be scheduled ahead, and what it schedules then (exact state).
"""

from __future__ import annotations

import argparse

import pytest

from engine import SamplingParams
from engine.core.request import RequestStatus
from engine.core.scheduler import SchedulerOutput
from engine.request.grammar_spec import GrammarSpec
from tests.engine.core.scheduler_harness import make_request, make_scheduler
from tests.engine.tiny_model import PROMPTS, assert_no_blocks_held, drain, finals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")


class StepLog:
    """Records, on an engine, each step the scheduler builds: how many of its requests took their input token from
    the step in flight, and which requests each step sampled for."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.placeholders: list[int] = []
        self.sampled: list[set[str]] = []
        schedule = engine.scheduler.schedule

        def logged(in_flight: SchedulerOutput | None = None) -> SchedulerOutput:
            out = schedule(in_flight=in_flight)
            self.placeholders.append(sum(item.takes_last_sample for item in out.scheduled))
            self.sampled.append({item.request.request_id for item in out.scheduled if item.samples})
            return out

        engine.scheduler.schedule = logged

    def num_sampling_steps(self, request_id: str) -> int:
        return sum(request_id in ids for ids in self.sampled)


def _stream(outputs: dict[str, list]) -> dict[str, list[tuple]]:
    """Each request's outputs, as what a client sees of them."""
    return {
        request_id: [(o.new_token_ids, o.delta_text, o.token_ids, o.text, o.finished, o.finish_reason,
                      o.stop_reason, o.logprobs) for o in outs]
        for request_id, outs in outputs.items()
    }


def _run(checkpoint, workload: list[tuple[str, object, SamplingParams]], *, async_scheduling: bool,  # noqa: ANN001
         **overrides: object) -> tuple[dict[str, list], StepLog, object]:
    engine = make_engine(checkpoint, async_scheduling=async_scheduling, **overrides)
    assert engine.async_scheduling is async_scheduling
    log = StepLog(engine)
    for request_id, prompt, params in workload:
        engine.add_request(request_id, prompt, params)
    outputs = drain(engine)
    assert_no_blocks_held(engine)
    if engine.runner.grammars is not None:
        assert engine.runner.grammars.num_requests == 0, "grammar matchers leaked"
    return outputs, log, engine


def _stop_token_after(token_ids: list[int], first: int) -> tuple[int, int]:
    """(a token of `token_ids` at index >= first that none before it is, its index): a stop token id the output is
    known to reach there."""
    for index in range(first, len(token_ids)):
        if token_ids[index] not in token_ids[:index]:
            return token_ids[index], index
    raise AssertionError(f"no token first seen at or after {first} in {token_ids}")


def test_every_stream_is_the_same_with_and_without(tiny_checkpoint) -> None:
    reference, _, engine = _run(tiny_checkpoint, [("ref", PROMPTS[1], greedy(max_tokens=20))], async_scheduling=False)
    ref = finals(reference)["ref"]
    stop_token, stop_index = _stop_token_after(ref.token_ids, 4)
    stop_text = ref.text[len(engine.tokenizer.decode(ref.token_ids[:6])):][:2]
    assert stop_text
    workload: list[tuple[str, object, SamplingParams]] = [
        ("greedy", PROMPTS[0], greedy(max_tokens=16)),
        ("seeded", PROMPTS[1], SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True)),
        ("logprobs", PROMPTS[2], SamplingParams(temperature=0.7, seed=5, max_tokens=12, logprobs=3, ignore_eos=True)),
        ("stop-token", PROMPTS[1], greedy(max_tokens=20, stop_token_ids=[stop_token])),
        ("stop-string", PROMPTS[1], greedy(max_tokens=20, stop=[stop_text])),
        ("long-prompt", list(range(5, 30)), greedy(max_tokens=7)),
    ]
    sync, sync_log, _ = _run(tiny_checkpoint, workload, async_scheduling=False)
    overlapped, log, _ = _run(tiny_checkpoint, workload, async_scheduling=True)

    assert _stream(overlapped) == _stream(sync)
    assert sum(sync_log.placeholders) == 0
    # The steps really overlapped: every token after a request's first came from a step scheduled ahead, its input
    # token taken from the step in flight.
    assert sum(log.placeholders) >= sum(len(o.token_ids) - 1 for o in finals(overlapped).values()), log.placeholders
    stopped = finals(overlapped)["stop-token"]
    assert (stopped.finish_reason, stopped.stop_reason, len(stopped.token_ids)) == ("stop", stop_token,
                                                                                    stop_index + 1)
    # Its step after the stopping one had been launched: one sampled token more than it output, discarded.
    assert log.num_sampling_steps("stop-token") == len(stopped.token_ids) + 1
    assert sync_log.num_sampling_steps("stop-token") == len(stopped.token_ids)
    # A length cap is known ahead: no step is launched past it.
    assert log.num_sampling_steps("greedy") == 16


def test_requests_that_need_their_last_token_on_the_host_give_the_same_streams(tiny_checkpoint) -> None:
    """Penalties, min_tokens and n > 1 (their steps run synchronously) beside requests that overlap."""
    workload: list[tuple[str, object, SamplingParams]] = [
        ("penalties", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3,
                                                 frequency_penalty=0.5, ignore_eos=True)),
        ("min-tokens", PROMPTS[0], SamplingParams(temperature=0.8, seed=3, max_tokens=12, min_tokens=6)),
        ("choices", PROMPTS[2], SamplingParams(n=3, temperature=0.8, seed=21, max_tokens=9, ignore_eos=True)),
        ("plain", PROMPTS[1], greedy(max_tokens=24)),
    ]
    sync, _, _ = _run(tiny_checkpoint, workload, async_scheduling=False)
    overlapped, log, _ = _run(tiny_checkpoint, workload, async_scheduling=True)
    assert _stream(overlapped) == _stream(sync)
    assert sum(log.placeholders) > 0  # once the others are done, "plain" overlaps


def test_preemption_and_chunked_prefill_give_the_same_tokens(tiny_checkpoint) -> None:
    """A pool too small for the batch (preemption, only ever after the step in flight is read) and a 6-token
    budget (prompts in chunks, scheduled ahead of the chunk in flight)."""
    workload: list[tuple[str, object, SamplingParams]] = [
        (f"r{i}", prompt, greedy(max_tokens=16) if i % 2 else
         SamplingParams(temperature=0.9, seed=100 + i, max_tokens=16, ignore_eos=True))
        for i, prompt in enumerate([*PROMPTS, list(range(40, 60))])
    ]
    settings = dict(max_model_len=48, max_num_batched_tokens=6, num_kv_blocks=12)
    sync, _, sync_engine = _run(tiny_checkpoint, workload, async_scheduling=False, **settings)
    overlapped, log, engine = _run(tiny_checkpoint, workload, async_scheduling=True, **settings)
    assert _stream(overlapped) == _stream(sync)
    assert engine.scheduler.num_preemptions > 0 and sync_engine.scheduler.num_preemptions > 0
    assert sum(log.placeholders) > 0


def test_a_handoff_between_async_engines_decodes_what_the_colocated_engine_decodes(tiny_checkpoint) -> None:
    """Prefill engine (its request leaves after its first token: never scheduled ahead) → KV over the in-process
    transport → decode engine, all three async: the colocated engine's tokens, every block back."""
    import torch

    from kv_transfer.reservation import ReservationSink, ReservationState
    from tests.engine.kv_harness import hand_off_prompt, steps_until_finished, transfer_link

    colocated, prefill, decode = (make_engine(tiny_checkpoint, async_scheduling=True) for _ in range(3))
    sink = ReservationSink(decode.kv_blocks.layout, torch.device("cpu"))
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    with transfer_link("inproc", sink, torch.device("cpu")) as (sender, endpoint):
        for i, prompt in enumerate(PROMPTS[:2]):
            colocated.add_request(f"r{i}", prompt, params)
            expected = steps_until_finished(colocated, f"r{i}")
            reservation, first_token = hand_off_prompt(prefill, decode, sender, sink, endpoint, f"r{i}", prompt,
                                                       params)
            assert reservation.state is ReservationState.COMMITTED
            decode.commit_remote(f"r{i}", first_token, None)
            assert steps_until_finished(decode, f"r{i}") == expected
    for engine in (colocated, prefill, decode):
        drain(engine)
        assert_no_blocks_held(engine)


def test_the_flag_travels_and_defaults_by_device(tiny_checkpoint) -> None:
    from engine.config import EngineConfig
    from engine.device import resolve_engine_config
    from engine.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).async_scheduling is None
    assert engine_config_from_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_config_from_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert resolve_engine_config(EngineConfig(device="cpu")).async_scheduling is False
    assert resolve_engine_config(EngineConfig(device="cpu", async_scheduling=True)).async_scheduling is True
    assert make_engine(tiny_checkpoint).async_scheduling is False
    # Speculative decoding runs every step synchronously.
    speculating = make_engine(tiny_checkpoint, async_scheduling=True, speculative_config={"method": "ngram"})
    assert speculating.async_scheduling is False


# -- the scheduler ---------------------------------------------------------------------------------------------------
def test_a_step_is_scheduled_ahead_of_the_one_in_flight() -> None:
    """Exact state: the request in flight at its prompt's last token gets one placeholder token at the next
    position; the one mid-prompt gets its next chunk; update_from_output, step by step, lands where it would."""
    scheduler, pool = make_scheduler(num_blocks=16, max_num_batched_tokens=10)
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=8)
    b = make_request("b", list(range(10, 22)), max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in first.scheduled] == [
        ("a", 0, 5, True), ("b", 0, 5, False)]
    assert scheduler.can_schedule_ahead(first)
    second = scheduler.schedule(in_flight=first)
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples, s.takes_last_sample)
            for s in second.scheduled] == [("a", 5, 1, True, True), ("b", 5, 7, True, False)]
    assert len(scheduler.kv_cache.block_ids("a")) == 2 and len(scheduler.kv_cache.block_ids("b")) == 3
    assert (a.num_computed_tokens, a.num_tokens) == (0, 5)  # nothing applied before the outputs come in
    scheduler.update_from_output(first, {"a": [40]})
    scheduler.update_from_output(second, {"a": [41], "b": [42]})
    assert (a.output_token_ids, a.num_computed_tokens, b.output_token_ids, b.num_computed_tokens) == (
        [40, 41], 6, [42], 12)
    assert pool.num_used_blocks == 5


@pytest.mark.parametrize(("params", "ahead"), [
    ({}, True),
    ({"repetition_penalty": 1.2}, False),
    ({"presence_penalty": 0.5}, False),
    ({"min_tokens": 3}, False),
    ({"structured_outputs": GrammarSpec(kind="regex", source="a+")}, True),  # its grammar takes the token in flight
])
def test_a_request_that_needs_its_last_token_on_the_host_is_not_scheduled_ahead(params: dict, ahead: bool) -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("r", [1, 2, 3], max_tokens=8, **params))
    assert scheduler.can_schedule_ahead(scheduler.schedule()) is ahead


def test_nothing_is_scheduled_ahead_that_could_preempt_and_a_sure_finish_sits_out() -> None:
    # 3 blocks of 4: "a" fills 2 with its prompt + 4 tokens, "b" one; a placeholder for each needs one block more.
    scheduler, _ = make_scheduler(num_blocks=3)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=8)
    b = make_request("b", [9, 9, 9, 9], max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["a", "b"]
    assert not scheduler.can_schedule_ahead(first)  # two more blocks, one free
    # A request whose in-flight token reaches its max_tokens is not scheduled ahead: it needs nothing more.
    scheduler2, _ = make_scheduler(num_blocks=8)
    last = make_request("last", [1, 2, 3], max_tokens=1)
    scheduler2.add_request(last)
    step = scheduler2.schedule()
    assert scheduler2.can_schedule_ahead(step)
    assert scheduler2.schedule(in_flight=step).is_empty
    scheduler2.update_from_output(step, {"last": [5]})
    assert last.status is RequestStatus.FINISHED_LENGTH
