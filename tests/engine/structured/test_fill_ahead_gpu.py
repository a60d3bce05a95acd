"""Filling the grammar bitmask ahead on a cuda engine (gpu-marked: they skip without CUDA).

    the mask on the device          xgrammar's Triton kernel on cuda logits, from a pinned bitmask, masks as the torch
                                    definition does (every row, and some rows)
    a cuda engine fills ahead       by default; the sampler gets pinned bitmasks filled on the matchers' thread, and
                                    the batch (schemas, a regex, a choice, an unconstrained row; greedy and seeded,
                                    CUDA graphs replayed) gets the tokens of the in-step fill, each valid under its
                                    grammar, every KV block back

The dummy SmolLM2 shape with the byte-level stand-in tokenizer: a GPU machine has neither the checkpoint nor a
network, and the grammars' tokens are bytes there.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.request.grammar_spec import GrammarSpec
from engine.request.sampling_params import SamplingParams
from engine.structured.bitmask import (
    PendingBitmask,
    TokenBitmask,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    pack_bitmask,
    ready,
)

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["kind", "count", "ok"],
    "properties": {"kind": {"enum": ["book", "film", "song"]}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999}, "ok": {"type": "boolean"}},
}
REGEX = r"(ab|cd){2,6}x"


@pytest.mark.parametrize("row_indices", [[0, 1, 2, 3, 4, 5], [1, 4], [5, 0, 3]])
def test_the_mask_on_cuda_logits_is_the_reference(row_indices: list[int]) -> None:
    vocab_size = 49152 + 7  # not a multiple of 32
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab_size, generator=generator).cuda()
    allowed = torch.rand(len(row_indices), vocab_size, generator=generator) < 0.3
    mask = TokenBitmask(bitmask=pack_bitmask(allowed).pin_memory(), row_indices=row_indices)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, mask)
    got = logits.clone()
    apply_token_bitmask(got, mask)
    assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader.checkpoint import Checkpoint
    from engine.loader.dummy_weights import (
        byte_level_tokenizer,
        dummy_checkpoint_path,
        dummy_model_config,
        dummy_model_id,
        dummy_weights,
    )

    shape = "smollm2-135m"
    model_config = dummy_model_config(shape)
    checkpoint = Checkpoint(
        config=model_config, weights=dummy_weights(model_config, dtype=torch.bfloat16, device="cuda", seed=0),
        tokenizer=byte_level_tokenizer(model_config), path=dummy_checkpoint_path(shape),
        model_id=dummy_model_id(shape, 0))
    config = EngineConfig(model=shape, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=256,
                          max_num_seqs=8, num_kv_blocks=256, seed=0, cuda_graph_sizes=(1, 2, 4, 8))
    engine = LLMEngine(config, checkpoint=checkpoint)
    yield engine
    if engine.runner.grammars is not None:
        engine.runner.grammars.close()


def _params() -> list[SamplingParams]:
    json_spec = GrammarSpec.json_schema(SCHEMA)
    return [
        SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=json_spec),
        SamplingParams(temperature=0.8, seed=5, max_tokens=96, structured_outputs=json_spec),
        SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=GrammarSpec(kind="regex", source=REGEX)),
        SamplingParams(temperature=0.7, seed=3, max_tokens=16, structured_outputs=GrammarSpec.choice(["yes", "no"])),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]


def _run(engine, tag: str) -> tuple[list, list]:  # noqa: ANN001
    """Every request's final output, and the bitmasks the sampler was given."""
    seen: list = []
    launch = engine.runner.sampler.launch  # what the runner calls (sample is launch(...).result())

    def spy(logits, rows, token_bitmask=None):  # noqa: ANN001, ANN202
        if token_bitmask is not None:
            seen.append(token_bitmask)
        return launch(logits, rows, token_bitmask)

    engine.runner.sampler.launch = spy
    try:
        params = _params()
        for i, p in enumerate(params):
            engine.add_request(f"{tag}{i}", "Give me an item as JSON.", p)
        done = {}
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        engine.runner.sampler.launch = launch
    assert engine.block_pool.num_used_blocks == 0, "KV blocks leaked"
    assert engine.runner.grammars.num_requests == 0, "grammar matchers leaked"
    return [done[f"{tag}{i}"] for i in range(len(params))], seen


def test_a_cuda_engine_fills_ahead_with_the_tokens_of_the_in_step_fill(engine) -> None:  # noqa: ANN001
    engine.inputs.grammar_compilers()
    grammars = engine.runner.grammars
    assert grammars.fill_ahead, "a cuda engine fills its grammar bitmasks ahead"
    ahead, seen = _run(engine, "a")
    assert seen and all(isinstance(m, PendingBitmask) for m in seen)
    assert all(ready(m).bitmask.is_pinned() for m in seen)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    grammars.fill_ahead = False
    try:
        in_step, seen = _run(engine, "s")
    finally:
        grammars.fill_ahead = True
    assert seen and all(isinstance(m, TokenBitmask) for m in seen)
    assert [o.token_ids for o in ahead] == [o.token_ids for o in in_step]
    assert all(o.error is None for o in ahead)
    for out in ahead[:2]:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert value["kind"] in SCHEMA["properties"]["kind"]["enum"] and 0 <= value["count"] <= 999
    assert ahead[2].finish_reason == "stop" and re.fullmatch(REGEX, ahead[2].text), ahead[2].text
    assert ahead[3].text in ("yes", "no")
