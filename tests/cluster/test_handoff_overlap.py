"""A prompt's KV handoff runs while the prefill worker computes the next prompt: it does not wait for that step.

The prefill worker's engine starts its next step as soon as one ends when prompts are queued. A handoff that asked
the engine thread for its block table after that (between steps) waited a whole prefill step, and its request's
first token with it (docs/benchmarks.md, "Pass 12": on 2 CPU cores, 0.5 to 1.3 s of a request's TTFT). Real
workers in this process (real gRPC, real KV handoff), SmolLM2; each prefill step is slowed by STEP_S so that the
ordering does not depend on the machine's speed.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine.request.sampling_params import SamplingParams
from engine.request.wire import sampling_params_to_proto
from protos import serving_pb2
from tests.cluster.worker_harness import generate, start_worker, stub, wait_blocks_free

pytestmark = pytest.mark.slow

STEP_S = 1.5  # each prefill step sleeps this long first
TWO_TOKENS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # a handoff, then one decode step


def slow_steps(worker, sleep_s: float) -> threading.Event:
    """Every step of `worker`'s engine sleeps `sleep_s` first (on its engine thread, as the step would compute); the
    event is set as the first one starts (the engine steps only with a request to run)."""
    engine = worker.runtime.engine
    step = engine.step
    started = threading.Event()

    def slow_step():  # noqa: ANN202
        started.set()
        time.sleep(sleep_s)
        return step()

    engine.step = slow_step
    return started


def test_a_handoff_does_not_wait_for_the_next_prompts_prefill_step(smollm2_checkpoint) -> None:
    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="p-overlap")
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-overlap")
    try:
        tok = smollm2_checkpoint.tokenizer
        first, second = (tok.encode(f"Prompt {name}: the rivers of Europe, from the longest, are") for name in "ab")
        first_step = slow_steps(prefill, STEP_S)
        done: dict[str, float] = {}
        results = {}

        def run(name: str, ids: list[int]) -> None:
            results[name] = generate(stub(decode), name, ids, TWO_TOKENS, prefill.endpoint)
            done[name] = time.monotonic()

        start = time.monotonic()
        a = threading.Thread(target=run, args=("a", first))
        a.start()
        assert first_step.wait(60), "the first prompt's prefill step never started"
        time.sleep(STEP_S / 3)  # the second prompt arrives while the first one's step runs: it waits for the next
        b = threading.Thread(target=run, args=("b", second))
        b.start()
        a.join(120)
        b.join(120)
        assert {name: r.finish_reason for name, r in results.items()} == {"a": "length", "b": "length"}, results
        assert all(len(r.token_ids) == 2 for r in results.values())
        # The first request's handoff ran during the second prompt's step, so it finished about one step before
        # the second. Waiting for that step to end instead, it finished with the second (0.1 s apart).
        assert done["b"] - done["a"] > STEP_S / 2, (done["a"] - start, done["b"] - start)
        wait_blocks_free(prefill, decode)
    finally:
        prefill.stop()
        decode.stop()


def test_a_handoff_does_not_wait_for_the_decode_workers_step(smollm2_checkpoint) -> None:
    """The decode worker is in a long decode step (its forward slowed to STEP_S * 2) when a disaggregated request
    arrives: its blocks are reserved, and its KV committed with its first token, while that step computes
    (EngineLoop.call_now), so the first token comes as soon as the prefill worker sends it. Done between steps, the
    reservation and the commit each waited for a step to end, and the first token with them."""
    from tests.cluster.worker_harness import slowed_forward

    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="p-busy-decode")
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-busy-decode")
    step_s = STEP_S * 2
    try:
        tok = smollm2_checkpoint.tokenizer
        # a stream the decode worker runs colocated, keeping it in (slowed) decode steps
        busy_ids = tok.encode("A long story about the sea:")
        long_run = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        busy = threading.Thread(target=lambda: generate(stub(decode), "busy", busy_ids, long_run))
        with slowed_forward(decode, step_s) as computing:
            busy.start()
            assert computing.wait(60), "the decode worker never stepped"
            time.sleep(0.2)  # well inside that step
            request = serving_pb2.GenerateRequest(
                request_id="arriving", prompt_token_ids=tok.encode("The capital of France is"),
                params=sampling_params_to_proto(TWO_TOKENS), prefill_endpoint=prefill.endpoint)
            began = time.monotonic()
            stream = stub(decode).Generate(request, timeout=120)
            first = next(stream)
            first_token_s = time.monotonic() - began
        rest = list(stream)
        busy.join(120)
        assert len(first.token_ids) == 1 and not first.error, first
        assert [m.finish_reason for m in rest if m.finish_reason] == ["length"]
        assert first_token_s < step_s / 2, f"the first token took {first_token_s:.2f}s: it waited for the step"
        wait_blocks_free(prefill, decode)
    finally:
        prefill.stop()
        decode.stop()
