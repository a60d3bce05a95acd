"""`splitserve serve --kv-cache-dtype int8` with 1 prefill + 1 decode worker over the torch transport (gloo; the
suite's one local serve over it: test_serve_openai.py serves grpc and ipc): the handoff carries int8
blocks and their scales, so the disaggregated cluster answers what the colocated int8 engine answers, token for
token; it moves int8's bytes (about a quarter of float32's), fits ~4x float32's blocks in the same
--kv-cache-memory, and every block comes back, after an aborted stream too.

Why its own cluster, not a case of test_serve_openai.py's `cluster` fixture: that module's tests repeat prompts and
send them concurrently, and with an int8 cache a prefill after cached context (a prefix hit, a retried handoff, a
chunked prompt) attends to dequantized keys where a fresh prefill attends to the unquantized ones, so those
outputs need not equal a fresh offline run. Here every prompt is distinct, sent once and alone, and prefilled in
one chunk: the prefill worker computes exactly what the offline engine computes, and the decode worker decodes
from the very int8 bytes and scales the offline engine would hold.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from engine.kv_cache_dtype import kv_block_bytes
from engine.request.sampling_params import SamplingParams
from kv_transfer.layout import cdiv
from tests.cluster.test_serve_openai import client_for, scrape, wait_until_every_block_is_free
from tests.cluster.worker_harness import engine_config
from tests.deploy.processes import ServeProcess, serve_argv, serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MAX_TOKENS = 24
BLOCK_SIZE = 16  # serve's default --block-size, and engine_config()'s
KV_CACHE_MEMORY = 256 << 20
PROMPTS = {  # no two share a first block: nothing is a prefix hit
    "short": "The three primary colors are",  # one partly filled block
    "long": "Write a long story about a lighthouse keeper and the sea. " * 8,  # ~100 tokens: 7 blocks
}


@pytest.fixture(scope="module")
def colocated_int8(smollm2_checkpoint) -> dict[str, list[int]]:
    """The int8 engine's greedy token ids for each prompt, each alone: what a colocated int8 worker answers."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(kv_cache_dtype="int8"), smollm2_checkpoint)
    out: dict[str, list[int]] = {}
    for name, prompt in PROMPTS.items():
        engine.add_request(name, smollm2_checkpoint.tokenizer.encode(prompt),
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        while engine.has_unfinished_requests():
            for result in engine.step():
                if result.finished:
                    out[name] = list(result.token_ids)
    assert engine.block_pool.num_used_blocks == 0
    return out


@pytest.fixture(scope="module")
def int8_cluster(smollm2_gguf: str, tmp_path_factory) -> Iterator[tuple[ServeProcess, str]]:
    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", "torch",
                      "--kv-cache-dtype", "int8", "--kv-cache-memory", "256MiB", "--max-model-len", "1024",
                      "--kv-transfer-timeout", "20",
                      "--disagg-prefill-threshold", "0")  # the short prompt through the KV handoff too
    with serving(argv, stderr_path=tmp_path_factory.mktemp("int8") / "stderr.txt") as serve:
        yield serve, serve.url


@pytest.mark.timeout(600)  # with the cluster's start-up, which pytest-timeout counts too
def test_int8_handoff_answers_what_the_colocated_int8_engine_answers(int8_cluster, colocated_int8,
                                                                     smollm2_checkpoint, smollm2_gguf) -> None:
    _serve, url = int8_cluster
    client = client_for(url)
    tok = smollm2_checkpoint.tokenizer
    mc = smollm2_checkpoint.config
    num_blocks_moved = 0
    for name, prompt in PROMPTS.items():  # one at a time: each prefilled fresh, in one chunk
        completion = client.completions.create(model=smollm2_gguf, prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0, logprobs=0)
        expected = colocated_int8[name]
        assert completion.choices[0].logprobs.tokens == [tok.decode([t], skip_special_tokens=False)
                                                         for t in expected], name
        assert completion.choices[0].text == tok.decode(expected, skip_special_tokens=True)
        num_blocks_moved += cdiv(completion.usage.prompt_tokens, BLOCK_SIZE)

    # Every handoff moved whole int8 blocks, scales included: 0.251x float32's bytes at SmolLM2's shape.
    int8_block_bytes = kv_block_bytes(mc, BLOCK_SIZE, torch.float32, "int8")
    fp32_block_bytes = kv_block_bytes(mc, BLOCK_SIZE, torch.float32, "auto")
    assert int8_block_bytes < 0.26 * fp32_block_bytes
    deadline_s = time.monotonic() + 30
    while True:  # the router's view of the workers' counters lags by a load poll
        metrics = scrape(url)
        moved = metrics.get("splitserve:kv_transfer_bytes_total", {}).get("prefill-0")
        if moved == num_blocks_moved * int8_block_bytes:
            break
        assert time.monotonic() < deadline_s, f"{moved} bytes moved, expected {num_blocks_moved} int8 blocks"
        time.sleep(0.5)
    assert metrics["splitserve:kv_transfer_failures_total"]["prefill-0"] == 0
    # The same --kv-cache-memory holds ~4x the blocks (at least 3.5x) of a float32 cache.
    for worker in ("prefill-0", "decode-0"):
        assert metrics["splitserve:kv_blocks_total"][worker] == KV_CACHE_MEMORY // int8_block_bytes
        assert metrics["splitserve:kv_blocks_total"][worker] >= 3.5 * (KV_CACHE_MEMORY // fp32_block_bytes)

    # A stream the client leaves after its first chunks: its blocks come back on both workers too.
    stream = client.completions.create(model=smollm2_gguf, prompt="List every prime number below one hundred.",
                                       max_tokens=200, temperature=0, stream=True)
    for i, _chunk in enumerate(stream):
        if i >= 2:
            break
    stream.close()
    used = wait_until_every_block_is_free(url)["splitserve:kv_blocks_used"]
    assert set(used) == {"prefill-0", "decode-0"}
