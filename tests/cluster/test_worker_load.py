"""A worker's load report (GetLoad) during a long step, as the router's poll reads it: real workers in this process
(real gRPC, real KV handoffs), SmolLM2, each forward slowed by STEP_S so that the ordering does not depend on the
machine's speed.

- It answers while the step computes, not when the step ends (the router's poll times out after 2 s; a prefill step
  of a long prompt takes longer on CPU), and counts a request whose queueing waits for that step as waiting.
- A decode worker counts the requests whose blocks it reserved and whose prompt KV is still on its way
  (`num_requests_receiving_kv`): they are in neither of its queues, yet they are its to decode.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine.request.sampling_params import SamplingParams
from protos import serving_pb2
from tests.cluster.worker_harness import generate, slowed_forward, start_worker, stub, wait_blocks_free

pytestmark = pytest.mark.slow

STEP_S = 3.0
TWO_TOKENS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def load(worker) -> tuple[serving_pb2.LoadStats, float]:
    """The worker's load and how long the call took."""
    began = time.monotonic()
    stats = stub(worker).GetLoad(serving_pb2.LoadRequest(), timeout=STEP_S * 3)
    return stats, time.monotonic() - began


def load_when(worker, predicate, within_s: float) -> serving_pb2.LoadStats:
    """Poll until the load satisfies `predicate`; every poll must answer well inside a step."""
    deadline = time.monotonic() + within_s
    while True:
        stats, took = load(worker)
        assert took < STEP_S / 4, f"GetLoad took {took:.2f}s: it waited for the step"
        if predicate(stats):
            return stats
        assert time.monotonic() < deadline, f"never seen: {stats}"
        time.sleep(0.02)


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_the_load_poll_answers_mid_step_and_counts_a_request_not_yet_queued(smollm2_checkpoint) -> None:
    worker = start_worker("colocated", smollm2_checkpoint, worker_id="c-load")
    tok = smollm2_checkpoint.tokenizer
    results = {}
    threads = []
    try:
        with slowed_forward(worker, STEP_S) as computing:
            for name in "ab":
                ids = tok.encode(f"Request {name}: the rivers of Europe, from the longest, are")
                threads.append(in_thread(lambda n=name, i=ids: results.update({n: generate(stub(worker), n, i,
                                                                                         TWO_TOKENS)})))
                if name == "a":
                    assert computing.wait(60), "the first request's step never started"
            # a's prefill computes; b's queueing waits for that step to end, and counts as waiting meanwhile.
            stats = load_when(worker, lambda s: s.num_requests_running + s.num_requests_waiting == 2, STEP_S / 2)
            assert (stats.num_requests_running, stats.num_requests_waiting) == (1, 1)
            assert stats.num_requests_receiving_kv == 0
        for thread in threads:
            thread.join(120)
        assert {n: r.finish_reason for n, r in results.items()} == {"a": "length", "b": "length"}, results
        stats, _ = load(worker)
        assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)
        wait_blocks_free(worker)
    finally:
        worker.stop()


def test_a_decode_worker_counts_the_requests_whose_kv_is_on_its_way(smollm2_checkpoint) -> None:
    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="p-load")
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-load")
    tok = smollm2_checkpoint.tokenizer
    results = {}
    try:
        with slowed_forward(prefill, STEP_S) as computing:
            ids = tok.encode("The longest rivers of Europe are")
            thread = in_thread(lambda: results.update(r=generate(stub(decode), "r", ids, TWO_TOKENS,
                                                                 prefill.endpoint)))
            assert computing.wait(60), "the prefill step never started"
            stats = load_when(decode, lambda s: s.num_requests_receiving_kv == 1, STEP_S / 2)
            assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)
            assert stats.kv_blocks_used > 0  # its reservation
        thread.join(120)
        assert results["r"].finish_reason == "length", results
        stats, _ = load(decode)
        assert (stats.num_requests_running, stats.num_requests_waiting, stats.num_requests_receiving_kv) == (0, 0, 0)
        wait_blocks_free(prefill, decode)
    finally:
        prefill.stop()
        decode.stop()
