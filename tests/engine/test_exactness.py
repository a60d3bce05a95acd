"""Greedy outputs of the engine are token-identical to HF transformers on the same weights (float32, CPU).

The HF side runs each prompt alone (no padding) with a plain greedy loop. The engine runs all prompts batched
together, mixing lengths, and must agree with prefix caching on, with chunked prefill forced small, and under
preemption, and with async scheduling (engine/core/overlap.py). After each workload every KV block is back in
the pool. At tensor_parallel_size 3 (SmolLM2's 9 query / 3 KV heads split three ways, real rank processes) the
tokens are TP 1's, every logits row within 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.distributed.tp_compare import SampledLogits, assert_tp_matches
from tests.engine.prompts import CHAT_CONVERSATIONS, SHORT_PROMPTS, long_prompt

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@pytest.fixture(scope="module")
def checkpoint(smollm2_checkpoint):
    """The session's float32 SmolLM2, not a second copy of it (~0.5 GB)."""
    return smollm2_checkpoint


def make_engine(checkpoint, **overrides):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    overrides.setdefault("max_model_len", 2048)
    # The workload holds 111 blocks at once; the default 2 GiB cache (2,900 blocks) is zeroed at every build
    overrides.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(dtype="float32", **overrides), checkpoint=checkpoint)


@pytest.fixture(scope="module")
def prompt_ids(checkpoint) -> list[list[int]]:
    tok = checkpoint.tokenizer
    ids = [tok.encode(p) for p in SHORT_PROMPTS]
    ids += [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in CHAT_CONVERSATIONS]
    long_ids = tok.encode(long_prompt())
    assert len(long_ids) > 1000
    ids.append(long_ids)
    return ids


@pytest.fixture(scope="module")
def expected(hf_reference, prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_reference, p, MAX_TOKENS) for p in prompt_ids]


def run_greedy(engine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Each prompt's greedy output (EOS ignored: exactly `max_tokens` tokens), checking no KV block leaked."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out
                done[out.request_id] = out.token_ids
    assert engine.block_pool.num_used_blocks == 0, "KV blocks leaked"
    return [done[f"r{i}"] for i in range(len(prompts))]


def assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    mismatches = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatches, f"prompts {mismatches} differ: got {[got[i] for i in mismatches]}, " \
                           f"want {[want[i] for i in mismatches]}"


@pytest.fixture(scope="module")
def tp1_greedy(checkpoint, prompt_ids) -> tuple[list[list[int]], SampledLogits]:
    """The batched greedy run at TP 1 (cpu attention backend), with every logits row its sampler saw."""
    engine = make_engine(checkpoint, enable_prefix_caching=False, attention_backend="cpu")
    logits = SampledLogits.install(engine)
    return run_greedy(engine, prompt_ids), logits


@pytest.mark.parametrize(("backend", "async_scheduling"), [("cpu", False), ("torch", False), ("cpu", True)])
def test_batched_greedy_matches_hf(checkpoint, prompt_ids, expected, backend, async_scheduling, request):
    if (backend, async_scheduling) == ("cpu", False):
        got = request.getfixturevalue("tp1_greedy")[0]
    else:
        got = run_greedy(make_engine(checkpoint, enable_prefix_caching=False, attention_backend=backend,
                                     async_scheduling=async_scheduling), prompt_ids)
    assert_same(got, expected)


def test_tensor_parallel_3_matches_tp1(checkpoint, prompt_ids, tp1_greedy):
    tokens1, logits1 = tp1_greedy
    num_threads = torch.get_num_threads()
    engine = make_engine(checkpoint, enable_prefix_caching=False, attention_backend="cpu", tensor_parallel_size=3)
    try:
        logits3 = SampledLogits.install(engine)
        tokens3 = run_greedy(engine, prompt_ids)
    finally:
        engine.close()
        torch.set_num_threads(num_threads)  # a TP engine sets its rank 0's threads process-wide
    ids = {f"r{i}": p for i, p in enumerate(prompt_ids)}
    by_id = lambda tokens: {f"r{i}": t for i, t in enumerate(tokens)}  # noqa: E731
    diff = assert_tp_matches(ids, by_id(tokens1), by_id(tokens3), logits1, logits3)
    print(f"TP 3 vs TP 1: max |logit diff| {diff:.3g} over {len(logits3.rows)} rows")


def test_prefix_cache_hits_keep_outputs_identical(checkpoint, prompt_ids, expected):
    engine = make_engine(checkpoint, enable_prefix_caching=True)
    assert_same(run_greedy(engine, prompt_ids), expected)
    # The same prompts again (and the chat ones share a system prompt): now served partly from cache.
    hits_before = engine.kv_cache.prefix_hits_tokens
    assert_same(run_greedy(engine, prompt_ids), expected)
    assert engine.kv_cache.prefix_hits_tokens - hits_before >= sum(len(p) for p in prompt_ids) // 2


def test_small_chunked_prefill_keeps_outputs_identical(checkpoint, prompt_ids, expected):
    engine = make_engine(checkpoint, max_num_batched_tokens=37, enable_prefix_caching=False)
    assert_same(run_greedy(engine, prompt_ids), expected)


def test_preemption_keeps_outputs_identical(checkpoint, prompt_ids, expected):
    # 80 blocks hold one 1,280-token request, but not this batch (about 111 blocks by the end). The long prompt
    # goes first, so the short ones are admitted into what is left and must preempt each other as they grow.
    engine = make_engine(checkpoint, num_kv_blocks=80, max_model_len=1280, enable_prefix_caching=True)
    got = run_greedy(engine, prompt_ids[::-1])[::-1]
    assert_same(got, expected)
    assert engine.scheduler.num_preemptions > 0
