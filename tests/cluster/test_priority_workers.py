"""Priority scheduling across the disaggregated split: real prefill and decode workers in this process (real gRPC,
real KV handoff), SmolLM2, all started with `--scheduling-policy priority`.

- The decode worker one request wide: an urgent request that arrives while a long low-priority one decodes is
  prefilled, handed over and then takes the only place: the long one is preempted, recomputed on the decode worker
  later, and still gives the tokens it gives alone.
- The decode worker's KV cache full: the urgent request's reservation (its prompt's blocks, before the handoff)
  takes the blocks of a running request it outranks, between steps.

Every block comes back on every worker. The decode worker's forwards are slowed so that the low-priority requests
are surely still decoding when the urgent one lands, whatever the machine's speed."""

from __future__ import annotations

import threading
import time

import pytest

from engine.request.sampling_params import SamplingParams
from protos import serving_pb2
from tests.cluster.worker_harness import generate, slowed_forward, start_worker, stub, wait_blocks_free

pytestmark = pytest.mark.slow

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, priority=5)
URGENT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, priority=0)


@pytest.fixture(scope="module")
def prefill(smollm2_checkpoint):  # type: ignore[no-untyped-def]
    worker = start_worker("prefill", smollm2_checkpoint, worker_id="p-prio", scheduling_policy="priority")
    yield worker
    worker.stop()


def test_an_urgent_request_displaces_a_long_one_on_a_full_decode_worker(smollm2_checkpoint, prefill) -> None:
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-prio", scheduling_policy="priority",
                          max_num_seqs=1)
    tok = smollm2_checkpoint.tokenizer
    long_ids = tok.encode("A long story about the sea, the ships that cross it and the people on them:")
    urgent_ids = tok.encode("Quick: the capital of France is")
    try:
        assert stub(decode).Health(serving_pb2.HealthRequest()).scheduling_policy == "priority"
        alone = generate(stub(decode), "long-alone", long_ids, LONG, prefill.endpoint)
        assert alone.finish_reason == "length" and len(alone.token_ids) == 40

        results, finished_s = {}, {}

        def run_long() -> None:
            results["long"] = generate(stub(decode), "long", long_ids, LONG, prefill.endpoint)
            finished_s["long"] = time.monotonic()

        with slowed_forward(decode, 0.1) as computing:
            thread = threading.Thread(target=run_long, daemon=True)
            thread.start()
            assert computing.wait(60), "the long request never reached the decode worker"
            results["urgent"] = generate(stub(decode), "urgent", urgent_ids, URGENT, prefill.endpoint)
            finished_s["urgent"] = time.monotonic()
            thread.join(120)
        assert results["urgent"].finish_reason == "length" and len(results["urgent"].token_ids) == 4
        assert finished_s["urgent"] < finished_s["long"]  # one place: only a preemption lets it finish first
        assert results["long"].token_ids == alone.token_ids  # recomputed after its preemption, the same tokens
        load = stub(decode).GetLoad(serving_pb2.LoadRequest(), timeout=10)
        assert load.num_preemptions == 1
        wait_blocks_free(prefill, decode)
    finally:
        decode.stop()


def test_an_urgent_reservation_takes_the_blocks_of_a_lower_request_on_a_full_kv_cache(
    smollm2_checkpoint, prefill,
) -> None:
    # 14 blocks of 16 tokens: two 79-token prompts reserve 5 blocks each (prompt + 1) and grow to 7 each (111 tokens
    # at most); an urgent 79-token prompt then needs 5, which only a preemption frees.
    decode = start_worker("decode", smollm2_checkpoint, worker_id="d-prio-kv", scheduling_policy="priority",
                          num_kv_blocks=14, max_model_len=192)
    ids = smollm2_checkpoint.tokenizer.encode(
        " ".join(f"Line {i}: the ships, the harbours and the people of the northern sea." for i in range(40)))
    prompts = {"low-a": ids[:79], "low-b": ids[200:279], "urgent": ids[400:479]}
    low = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, priority=5)
    try:
        alone = {name: generate(stub(decode), f"{name}-alone", prompts[name], low, prefill.endpoint).token_ids
                 for name in ("low-a", "low-b")}
        results, finished_s = {}, {}

        def run(name: str, params: SamplingParams) -> None:
            results[name] = generate(stub(decode), name, prompts[name], params, prefill.endpoint)
            finished_s[name] = time.monotonic()

        with slowed_forward(decode, 0.1):
            threads = [threading.Thread(target=run, args=(name, low), daemon=True) for name in ("low-a", "low-b")]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 60
            while stub(decode).GetLoad(serving_pb2.LoadRequest(), timeout=10).num_requests_running < 2:
                assert time.monotonic() < deadline, "the low-priority requests never both ran"
                time.sleep(0.02)
            run("urgent", URGENT)
            for thread in threads:
                thread.join(120)
        assert results["urgent"].finish_reason == "length" and len(results["urgent"].token_ids) == 4
        assert finished_s["urgent"] < min(finished_s["low-a"], finished_s["low-b"])
        assert {name: results[name].token_ids for name in alone} == alone
        assert stub(decode).GetLoad(serving_pb2.LoadRequest(), timeout=10).num_preemptions >= 1
        wait_blocks_free(prefill, decode)
    finally:
        decode.stop()
