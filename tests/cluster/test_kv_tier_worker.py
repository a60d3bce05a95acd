"""A colocated worker with a disk KV tier (`--kv-offload-dir`), over gRPC with the real SmolLM2: a returning chat
whose history other traffic evicted is served from the tier with the tokens of a fresh engine, GetLoad reports
the tier's hits and bytes (what /metrics exports as prefix_cache_hits_total{tier}, kv_offload_bytes_total), and a
worker restarted on the same directory loads the history again. Every block goes back."""

from __future__ import annotations

import random

import pytest

from engine.request.sampling_params import SamplingParams
from protos import serving_pb2
from tests.cluster.worker_harness import generate, start_worker, stub, wait_blocks_free

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ENGINE = dict(num_kv_blocks=24, max_model_len=384, block_size=16)
RNG = random.Random(5)
HISTORY = RNG.choices(range(100, 40_000), k=160)  # 10 blocks; the two others (13 blocks each) evict them
OTHERS = [RNG.choices(range(100, 40_000), k=200) for _ in range(2)]


def test_colocated_worker_serves_a_returning_chat_from_its_disk_tier(smollm2_checkpoint, tmp_path) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    tier = dict(kv_offload_dir=str(tmp_path), kv_offload_size_bytes=1 << 30)
    worker = start_worker("colocated", smollm2_checkpoint, worker_id="c-tier", **ENGINE, **tier)
    try:
        s = stub(worker)
        first = generate(s, "turn-1", HISTORY, GREEDY).token_ids
        for i, other in enumerate(OTHERS):
            generate(s, f"other-{i}", other, GREEDY)
        returning = HISTORY + first + [28, 198]
        second = generate(s, "turn-2", returning, GREEDY).token_ids
        load = s.GetLoad(serving_pb2.LoadRequest(), timeout=10)
        wait_blocks_free(worker)
    finally:
        worker.stop()
    fresh = LLMEngine(EngineConfig(**ENGINE), smollm2_checkpoint)  # type: ignore[arg-type]
    fresh.add_request("r", returning, GREEDY)
    expected = [o for _ in range(100) for o in fresh.step() if o.finished]
    assert second == expected[0].token_ids
    assert dict(load.prefix_cache_hits_by_tier) == {"device": 0, "disk": 160, "peer": 0}
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 16 tokens, 3 KV heads of 64, float32
    assert load.kv_offload_bytes["read"] == 10 * block_bytes
    assert load.kv_offload_bytes["write"] >= 10 * block_bytes

    restarted = start_worker("colocated", smollm2_checkpoint, worker_id="c-tier", incarnation=1, **ENGINE, **tier)
    try:
        s = stub(restarted)
        assert generate(s, "turn-2-again", returning, GREEDY).token_ids == second
        assert dict(s.GetLoad(serving_pb2.LoadRequest(), timeout=10).prefix_cache_hits_by_tier)["disk"] == 160
        wait_blocks_free(restarted)
    finally:
        restarted.stop()
