"""Structured outputs on the real SmolLM2-135M, offline: 50 generated JSON schemas in one batch all give JSON that
validates; greedy output under a grammar is the same with prompt-lookup speculation on and off (drafts the grammar
rejects are cut before verification), and with async scheduling; every KV block and every matcher is released
afterwards.

Kept cheap (the whole suite has a time budget): the session's one loaded checkpoint, one engine without speculation
shared by both tests, flat schemas (depth 1) whose JSON fits in `MAX_TOKENS`, all 50 submitted at once, a KV cache
sized to the batch rather than the default 2 GiB."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.request.grammar_spec import GrammarSpec
from engine.request.sampling_params import SamplingParams
from tests.engine.structured.schemas import generated_schema

pytestmark = pytest.mark.slow

NUM_SCHEMAS = 50
MAX_TOKENS = 64  # a flat schema's compact JSON is ~15-45 SmolLM2 tokens; a request cut by the limit fails the test


def _engine(checkpoint, **overrides):  # noqa: ANN001, ANN202
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    # 50 requests x (a ~40-token prompt + MAX_TOKENS) need ~7 blocks of 16 tokens each: 512 blocks leave room.
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=256, max_num_seqs=NUM_SCHEMAS, num_kv_blocks=512,
                                  **overrides), checkpoint=checkpoint)


@pytest.fixture(scope="module")
def engine(smollm2_checkpoint):  # noqa: ANN001, ANN201
    """One engine (no speculation) for the module."""
    return _engine(smollm2_checkpoint)


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


def test_fifty_generated_schemas_all_validate(smollm2_checkpoint, engine) -> None:  # noqa: ANN001
    tok = smollm2_checkpoint.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe an item as JSON."}]),
                        add_special_tokens=False)
    schemas = [generated_schema(seed, depth=1) for seed in range(NUM_SCHEMAS)]
    assert len({json.dumps(schema) for schema in schemas}) == NUM_SCHEMAS
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=GrammarSpec.json_schema(schema)) for i, schema in enumerate(schemas)]
    compiled_before = engine.inputs.grammar_compilers().num_compiled
    outputs = _run(engine, [prompt] * NUM_SCHEMAS, params)
    for schema, out in zip(schemas, outputs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.inputs.grammar_compilers().num_compiled - compiled_before == NUM_SCHEMAS


def test_greedy_under_a_grammar_is_identical_with_prompt_lookup(smollm2_checkpoint, engine) -> None:  # noqa: ANN001
    """The prompt makes the n-gram drafts continue "a b c ...", which the regex rejects at every "c"."""
    tok = smollm2_checkpoint.tokenizer
    prompts = [tok.encode("a b c a b c a b c a b c a b"), tok.encode("Count: 1 2 3 1 2 3 1 2 3 1 2")]
    pattern = r"a( b| d){2,8}\."
    spec = GrammarSpec(kind="regex", source=pattern)
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec) for _ in prompts]
    expected = _run(engine, prompts, params)
    speculating = _engine(smollm2_checkpoint, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "policy": "fixed", "prompt_lookup_min": 1})
    got = _run(speculating, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    # Async scheduling: a grammar's steps read the last token on the host first (engine/core/overlap.py).
    overlapped = _run(_engine(smollm2_checkpoint, async_scheduling=True), prompts, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in expected]
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in got), [o.text for o in got]
    assert speculating.stats().spec_decode_num_draft_tokens > 0


def test_filling_ahead_gives_the_tokens_of_the_in_step_fill(smollm2_checkpoint, engine) -> None:  # noqa: ANN001
    """The bitmask filled on the matchers' thread beside the forward (on for cuda engines; forced on here) gives
    every request the tokens of the fill in the step, in a batch mixing schemas, a regex and an unconstrained row."""
    tok = smollm2_checkpoint.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe an item as JSON."}]),
                        add_special_tokens=False)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=GrammarSpec.json_schema(generated_schema(seed=i, depth=1)))
              for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=GrammarSpec(
        kind="regex", source=r"a( b| d){2,8}\.")), SamplingParams(temperature=0.0, max_tokens=8)]
    prompts = [prompt] * len(params)
    expected = _run(engine, prompts, params)
    grammars = engine.runner.grammars
    grammars.fill_ahead = True
    try:
        got = _run(engine, prompts, params)
    finally:
        grammars.fill_ahead = False
        grammars.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "stop" for o in got[:4]), [o.text for o in got]


@pytest.mark.parametrize("fill_ahead", [False, True], ids=["fill-in-step", "fill-ahead"])
def test_async_scheduling_overlaps_grammar_steps_and_gives_the_same_tokens(smollm2_checkpoint, engine,  # noqa: ANN001
                                                                         fill_ahead: bool) -> None:
    """With async scheduling a structured request's step N+1 is scheduled and launched before step N's token
    reaches the host (its grammar takes that token when N+1's mask is filled): the same tokens as the synchronous
    engine, schemas (greedy and seeded) beside a regex and an unconstrained request; the mask filled in the step
    (CPU's default) and ahead on the fill thread with the sampling deferred (cuda's; forced on here)."""
    tok = smollm2_checkpoint.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe an item as JSON."}]),
                        add_special_tokens=False)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=GrammarSpec.json_schema(generated_schema(seed=10 + i, depth=1)))
              for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=GrammarSpec(
        kind="regex", source=r"a( b| d){2,8}\.")), SamplingParams(temperature=0.0, max_tokens=8)]
    prompts = [prompt] * len(params)
    expected = _run(engine, prompts, params)
    overlapped = _engine(smollm2_checkpoint, async_scheduling=True)
    placeholders = []  # structured requests that took their input token from the step in flight, a step
    schedule = overlapped.scheduler.schedule

    def logged(in_flight=None):  # noqa: ANN001, ANN202
        out = schedule(in_flight=in_flight)
        placeholders.append(sum(item.takes_last_sample and item.request.sampling_params.structured_outputs is not None
                                for item in out.scheduled))
        return out

    overlapped.scheduler.schedule = logged
    warm = SamplingParams(max_tokens=1, structured_outputs=GrammarSpec(kind="regex", source="a"))
    _run(overlapped, [prompt], [warm])  # its matchers exist from the first structured request on
    overlapped.runner.grammars.fill_ahead = fill_ahead
    placeholders.clear()
    try:
        got = _run(overlapped, prompts, params)
    finally:
        overlapped.runner.grammars.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert all(o.finish_reason == "stop" for o in got[:4]), [o.text for o in got]
    # Every structured token after a request's first came from a step scheduled ahead of the one sampling it.
    assert sum(placeholders) >= sum(len(o.token_ids) - 1 for o in got[:4]), placeholders
