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
