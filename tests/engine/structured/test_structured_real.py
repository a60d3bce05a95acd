"""Structured outputs on the real SmolLM2-135M, offline: 50 generated JSON schemas in one batch all give JSON that
validates; greedy output under a grammar is the same with prompt-lookup speculation on and off (drafts the grammar
rejects are cut before verification); every KV block and every matcher is released afterwards."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.core.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec
from tests.engine.structured.schemas import generated_schema

pytestmark = pytest.mark.slow

NUM_SCHEMAS = 50


def _engine(checkpoint, **overrides):  # noqa: ANN001, ANN202
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", max_model_len=1024, max_num_seqs=64, **overrides),
                     checkpoint=checkpoint)


def _run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:  # noqa: ANN001
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.block_pool.num_used_blocks == 0, "KV blocks leaked"
    assert engine.runner.grammars.num_requests == 0, "grammar matchers leaked"
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_fifty_generated_schemas_all_validate(smollm2_checkpoint) -> None:
    tok = smollm2_checkpoint.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe an item as JSON."}]),
                        add_special_tokens=False)
    schemas = [generated_schema(seed) for seed in range(NUM_SCHEMAS)]
    engine = _engine(smollm2_checkpoint)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=128,
                             structured_outputs=GrammarSpec.json_schema(schema)) for i, schema in enumerate(schemas)]
    outputs = _run(engine, [prompt] * NUM_SCHEMAS, params)
    for schema, out in zip(schemas, outputs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.grammar_compilers().num_compiled == NUM_SCHEMAS


def test_greedy_under_a_grammar_is_identical_with_prompt_lookup(smollm2_checkpoint) -> None:
    """The prompt makes the n-gram drafts continue "a b c ...", which the regex rejects at every "c"."""
    tok = smollm2_checkpoint.tokenizer
    prompts = [tok.encode("a b c a b c a b c a b c a b"), tok.encode("Count: 1 2 3 1 2 3 1 2 3 1 2")]
    pattern = r"a( b| d){2,8}\."
    spec = GrammarSpec(kind="regex", source=pattern)
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec) for _ in prompts]
    expected = _run(_engine(smollm2_checkpoint), prompts, params)
    engine = _engine(smollm2_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                             "policy": "fixed", "prompt_lookup_min": 1})
    got = _run(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in got), [o.text for o in got]
    assert engine.stats().spec_decode_num_draft_tokens > 0
