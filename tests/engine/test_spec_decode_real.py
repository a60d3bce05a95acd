"""Speculative decoding on the real SmolLM2-135M: greedy output token-identical with prompt lookup on and off, on a
mixed batch (short, chat-templated, repetitive and a > 300-token prompt), then again with the prompts as prefix
cache; every KV block back afterwards. Short outputs keep it quick; the tiny-model tests cover the mechanics."""

from __future__ import annotations

import pytest

from tests.engine.prompts import CHAT_CONVERSATIONS, SHORT_PROMPTS, long_prompt
from tests.engine.test_exactness import run_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


def _engine(checkpoint, **overrides):  # noqa: ANN001, ANN202
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    # 4 prompts of at most ~330 tokens: 256 blocks hold them many times over (the default 2 GiB cache is zeroed at
    # every build)
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=2048, num_kv_blocks=256, **overrides),
                     checkpoint=checkpoint)


def test_greedy_is_identical_with_prompt_lookup(smollm2_checkpoint) -> None:
    tok = smollm2_checkpoint.tokenizer
    prompts = [tok.encode(p) for p in (SHORT_PROMPTS[5], "a b c a b c a b c a b")]
    prompts.append(tok.encode(tok.apply_chat_template(CHAT_CONVERSATIONS[1], add_generation_prompt=True),
                              add_special_tokens=False))
    prompts.append(tok.encode(long_prompt(min_words=300)))
    assert len(prompts[-1]) > 300
    expected = run_greedy(_engine(smollm2_checkpoint), prompts, MAX_TOKENS)
    engine = _engine(smollm2_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                             "policy": "fixed"})
    assert run_greedy(engine, prompts, MAX_TOKENS) == expected
    assert run_greedy(engine, prompts[-1:], MAX_TOKENS) == expected[-1:]  # a prefix-cache hit this time
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert engine.block_pool.num_used_blocks == 0
