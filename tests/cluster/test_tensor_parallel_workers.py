"""Prefill and decode workers of different tensor-parallel sizes, with real rank processes, on the real SmolLM2 (9
query / 3 KV heads: TP 3 gives each rank one KV head), over real gRPC and a real KV transport (grpc, torch/gloo),
each rank sending and taking its own heads.

Prefill TP 3 → decode TP 1, TP 1 → TP 3 and TP 3 → TP 3 each give the offline TP 1 engine's greedy answer; the
handoff moves exactly the bytes of the blocks that travel (each KV head once: no rank's copy goes through another);
every rank's blocks come back to the pool.
"""

from __future__ import annotations

import pytest

from engine.request.sampling_params import SamplingParams
from kv_transfer.layout import cdiv
from tests.cluster.worker_harness import engine_config, generate, start_worker, stub, wait_blocks_free

pytestmark = [pytest.mark.slow]

ENGINE = dict(num_kv_blocks=48, max_model_len=512, num_threads=1)
MAX_TOKENS = 6
# One prompt per pair, so that no decode worker holds a prompt's blocks from an earlier pair (all of them travel).
PROMPTS = {
    (3, 1): "The lighthouse keeper climbed the stairs at dusk and lit the lamp, as he had done for forty years.",
    (1, 3): "A short poem about the sea, the wind and the gulls that follow the fishing boats home at night:",
    (3, 3): "Explain in two sentences why the sky is blue during the day and red at sunset, for a child.",
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(smollm2_checkpoint) -> dict[tuple[int, int], list[int]]:
    """Each prompt's greedy tokens from the offline TP 1 engine."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(**ENGINE), smollm2_checkpoint)
    answers = {}
    for pair, prompt in PROMPTS.items():
        engine.add_request(str(pair), smollm2_checkpoint.tokenizer.encode(prompt), PARAMS)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    answers[pair] = out.token_ids
    return answers


@pytest.fixture(scope="module", params=["grpc", "torch"])
def workers(request, smollm2_checkpoint):  # noqa: ANN001, ANN201
    """{("prefill" | "decode", tp): worker} for TP 1 and 3 of each role, over one transport."""
    transport = request.param
    started = {}
    try:
        for role in ("prefill", "decode"):
            for tp in (1, 3):
                started[role, tp] = start_worker(role, smollm2_checkpoint, transport=transport, timeout_s=60,
                                                 worker_id=f"{role}-tp{tp}", tensor_parallel_size=tp, **ENGINE)
        yield started
    finally:
        for worker in started.values():
            worker.stop()


@pytest.mark.parametrize("pair", list(PROMPTS))
def test_a_handoff_between_tensor_parallel_sizes_gives_the_tp1_answer(workers, expected, smollm2_checkpoint,
                                                                       pair: tuple[int, int]) -> None:
    prefill, decode = workers["prefill", pair[0]], workers["decode", pair[1]]
    assert decode.runtime.layout.tensor_parallel_size == pair[1]
    prompt_ids = smollm2_checkpoint.tokenizer.encode(PROMPTS[pair])
    sent_before = prefill.runtime.transfers.num_bytes
    sides = {"sent": prefill, "received": decode}
    lanes_before = {side: _lane_bytes(worker, side) for side, worker in sides.items()}
    result = generate(stub(decode), f"tp-{pair[0]}-{pair[1]}", prompt_ids, PARAMS, prefill_endpoint=prefill.endpoint)
    assert result.error == "" and result.finish_reason == "length"
    assert result.token_ids == expected[pair]
    layout = decode.runtime.layout  # SmolLM2's 3 KV heads: each travels once whichever side splits them
    num_blocks = cdiv(len(prompt_ids), layout.block_size)
    assert prefill.runtime.transfers.num_bytes - sent_before == num_blocks * layout.block_bytes
    wait_blocks_free(prefill, decode)
    # Each rank at TP 3 sends (prefill) or takes (decode) its own one KV head of each block, in its own process
    # (kv_transfer/rank_lanes.py): a third of the bytes each, as GetLoad reports them (kv_lane_bytes_total).
    for side, worker in sides.items():
        after = _lane_bytes(worker, side)
        if len(after) > 1:
            moved = {rank: after[rank] - lanes_before[side][rank] for rank in after}
            assert moved == {rank: num_blocks * layout.block_bytes // 3 for rank in range(3)}, (side, moved)


def _lane_bytes(worker, side: str) -> dict[int, int]:  # noqa: ANN001
    """{rank: the KV lane bytes it sent (`side` "sent") or took ("received")}, from the worker's GetLoad."""
    from protos import serving_pb2

    ranks = stub(worker).GetLoad(serving_pb2.LoadRequest(), timeout=10).ranks
    return {r.rank: getattr(r, f"kv_lane_bytes_{side}") for r in ranks}


def test_a_killed_rank_ends_the_stream_cleanly_fails_health_and_frees_every_block(smollm2_checkpoint) -> None:
    """SIGKILL of decode rank 2 mid-stream: the stream ends with an error naming the rank (no hang), Health says
    the worker is dead (the controller then restarts it whole, every rank a new incarnation), and the worker's
    pool, every rank's blocks, holds nothing."""
    import os
    import signal
    import threading

    from protos import serving_pb2

    prefill = start_worker("prefill", smollm2_checkpoint, worker_id="prefill-k", timeout_s=60, **ENGINE)
    decode = start_worker("decode", smollm2_checkpoint, worker_id="decode-k", timeout_s=60, tensor_parallel_size=3,
                          **ENGINE)
    try:
        pids = decode.runtime.engine.rank_pids()
        assert len(pids) == 2 and all(pid != os.getpid() for pid in pids)
        assert stub(decode).Health(serving_pb2.HealthRequest(), timeout=10).ok
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streamed = threading.Event()
        outcome: list = []

        def stream() -> None:
            request = generate_request("killed", smollm2_checkpoint.tokenizer.encode(PROMPTS[3, 1]), long,
                                       prefill.endpoint)
            tokens, finish = [], None
            for msg in stub(decode).Generate(request, timeout=120):
                tokens += msg.token_ids
                streamed.set()
                if msg.finish_reason:
                    finish = (msg.finish_reason, msg.error)
            outcome.append((tokens, finish))

        thread = threading.Thread(target=stream)
        thread.start()
        assert streamed.wait(60)
        os.kill(pids[1], signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "the stream hung on the dead rank"
        tokens, (finish_reason, error) = outcome[0]
        assert finish_reason == "error" and f"rank 2 (pid {pids[1]}) was killed by signal 9" in error, error
        assert 0 < len(tokens) < 400
        assert not stub(decode).Health(serving_pb2.HealthRequest(), timeout=10).ok
        wait_blocks_free(prefill, decode)
    finally:
        decode.stop()
        prefill.stop()


def generate_request(request_id: str, prompt_ids: list[int], params: SamplingParams, prefill_endpoint: str):  # noqa: ANN201
    from engine.request.wire import sampling_params_to_proto
    from protos import serving_pb2

    return serving_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                       params=sampling_params_to_proto(params), prefill_endpoint=prefill_endpoint)


def test_each_rank_holds_a_third_of_the_weights_and_of_the_kv_cache(workers) -> None:
    """GetLoad's ranks (splitserve:worker_rank_*): a TP 3 worker's every rank, its own process, each ~1/3 of the TP 1
    worker's weights (the vocabulary-split embedding/LM head included; only the norms are replicated) and exactly
    1/3 of its KV cache (one of the 3 KV heads of every block)."""
    import os

    from protos import serving_pb2

    whole, = stub(workers["decode", 1]).GetLoad(serving_pb2.LoadRequest(), timeout=10).ranks
    split = stub(workers["decode", 3]).GetLoad(serving_pb2.LoadRequest(), timeout=10).ranks
    assert [r.rank for r in split] == [0, 1, 2]
    assert [r.pid for r in split] == [os.getpid(), *workers["decode", 3].runtime.engine.rank_pids()]
    for rank in split:
        assert rank.weight_bytes == pytest.approx(whole.weight_bytes / 3, rel=0.01)
        assert rank.kv_cache_bytes * 3 == whole.kv_cache_bytes
