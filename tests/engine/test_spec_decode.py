"""Speculative decoding on the tiny model: outputs identical with speculation on and off, blocks all returned.

Greedy is token-identical; seeded random sampling is too (the rejection sampler draws each position's token as the
sampler would, and puts the request's generator back after a rejection), logprobs included. Workloads: mixed
lengths, chunked prefill, prefix-cache hits, preemption, aborts, stop strings inside accepted drafts. Each test
also checks that drafts were accepted, so that it could not pass without speculating.
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.tiny_model import (
    PROMPTS,
    BlockRefCounter,
    assert_no_blocks_held,
    drain,
    finals,
    greedy,
    make_engine,
    pick_stop_string,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
LAYER_SKIP = {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 1}  # the tiny model has 2
# The tiny model drafting for itself: every draft must be accepted (greedy).
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "model": "<the tiny model>"}
METHODS = [pytest.param(NGRAM, id="ngram"), pytest.param(LAYER_SKIP, id="layer_skip"),
           pytest.param(SELF_DRAFT, id="draft_model")]
# Mixed lengths; the tiny model falls into loops quickly, which prompt lookup drafts well.
MIXED = [*PROMPTS, list(range(3, 60)), "Hello world Hello world Hello"]


def _run(engine, prompts, params, prefix: str = "r") -> dict[str, list[int]]:  # noqa: ANN001
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params if isinstance(params, SamplingParams) else params[i])
    return {r: o.token_ids for r, o in finals(drain(engine)).items()}


def _spec_engine(checkpoint, policy: str = "fixed", method: dict = NGRAM, **overrides):  # noqa: ANN001, ANN202
    if method.get("method") == "draft_model":
        method = {**method, "model": str(checkpoint.path)}
    return make_engine(checkpoint, speculative_config={**method, "policy": policy}, **overrides)


def _assert_speculated(engine, *, greedy: bool = True) -> None:  # noqa: ANN001
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0, "no draft was accepted: the test did not speculate"
    if greedy and engine.config.speculative_config.method == "draft_model":  # the target drafting for itself
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens, "a self-draft rejected"
    else:
        assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens, "no draft was rejected"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 12}, {"enable_prefix_caching": False}, {"async_scheduling": True}],
    ids=["default", "chunked-prefill", "no-prefix-cache", "async-scheduling"],  # async: runs synchronously
)
def test_greedy_is_identical_with_speculation(tiny_checkpoint, overrides: dict, method: dict) -> None:
    expected = _run(make_engine(tiny_checkpoint, **overrides), MIXED, greedy(max_tokens=24))
    engine = _spec_engine(tiny_checkpoint, method=method, **overrides)
    counter = BlockRefCounter(engine)
    assert _run(engine, MIXED, greedy(max_tokens=24)) == expected
    _assert_speculated(engine)
    assert_no_blocks_held(engine)
    counter.assert_balanced()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_identical_with_prefix_cache_hits(tiny_checkpoint, method: dict) -> None:
    expected = _run(make_engine(tiny_checkpoint), MIXED, greedy(max_tokens=24))
    engine = _spec_engine(tiny_checkpoint, method=method)
    assert _run(engine, MIXED, greedy(max_tokens=24)) == expected
    # Again on the same engine: the prompts (and blocks of accepted drafts) are now prefix cache.
    engine.add_request("again", MIXED[4], greedy(max_tokens=24))
    out = finals(drain(engine))["again"]
    assert out.token_ids == expected["r4"]
    assert out.stats.num_cached_tokens > 0
    _assert_speculated(engine)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_identical_under_preemption(tiny_checkpoint, method: dict) -> None:
    expected = _run(make_engine(tiny_checkpoint), MIXED, greedy(max_tokens=40))
    # max_model_len 128 = 32 blocks: one request fits, several do not
    engine = _spec_engine(tiny_checkpoint, method=method, num_kv_blocks=40)
    counter = BlockRefCounter(engine)
    assert _run(engine, MIXED, greedy(max_tokens=40)) == expected
    assert engine.stats().num_preemptions > 0
    _assert_speculated(engine)
    assert_no_blocks_held(engine)
    counter.assert_balanced()


@pytest.mark.parametrize("method", METHODS)
def test_aborts_return_every_block(tiny_checkpoint, method: dict) -> None:
    expected = _run(make_engine(tiny_checkpoint), MIXED, greedy(max_tokens=30))
    engine = _spec_engine(tiny_checkpoint, method=method)
    counter = BlockRefCounter(engine)
    for i, prompt in enumerate(MIXED):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens=30))
    outputs: dict[str, list] = {}
    for step in range(12):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if step == 3:  # mid-decode
            for out in engine.abort_request(["r1", "r4", "r5"]):
                outputs.setdefault(out.request_id, []).append(out)
    for request_id, outs in drain(engine).items():
        outputs.setdefault(request_id, []).extend(outs)
    final = {r: outs[-1] for r, outs in outputs.items()}
    assert {r for r, o in final.items() if o.finish_reason == "abort"} == {"r1", "r4", "r5"}
    for r in ("r0", "r2", "r3"):
        assert final[r].token_ids == expected[r]
    _assert_speculated(engine)
    # The draft's KV lives in the requests' own blocks: all back with them, and no per-request draft state left.
    assert_no_blocks_held(engine)
    counter.assert_balanced()
    assert getattr(engine.speculator.proposer, "_valid", {}) == {}


def test_a_different_draft_model_is_identical_and_partly_accepted(tiny_model_dir, tiny_checkpoint, tmp_path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    # A draft close to the target but not equal: its weights with noise (a distilled draft, in miniature).
    other = tmp_path / "noisy-tiny"
    shutil.copytree(tiny_model_dir, other)
    gen = torch.Generator().manual_seed(1)
    weights = {name: w + 0.15 * w.std() * torch.randn(w.shape, generator=gen)
               for name, w in load_file(str(other / "model.safetensors")).items()}
    save_file(weights, str(other / "model.safetensors"))
    expected = _run(make_engine(tiny_checkpoint), MIXED, greedy(max_tokens=24))
    engine = make_engine(tiny_checkpoint, speculative_config={**SELF_DRAFT, "model": str(other), "policy": "fixed"})
    assert _run(engine, MIXED, greedy(max_tokens=24)) == expected
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_no_blocks_held(engine)


def test_dynamic_policy_is_identical_and_chooses_k(tiny_checkpoint) -> None:
    expected = _run(make_engine(tiny_checkpoint), MIXED, greedy(max_tokens=24))
    engine = _spec_engine(tiny_checkpoint, policy="dynamic")
    assert _run(engine, MIXED, greedy(max_tokens=24)) == expected
    chosen = engine.stats().spec_decode_chosen_k
    assert sum(chosen.values()) > 0 and set(chosen) <= set(range(5))
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_and_logprobs_are_identical_with_speculation(tiny_checkpoint, method: dict) -> None:
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, repetition_penalty=r, seed=100 + i, max_tokens=24,
                       ignore_eos=True, logprobs=2)
        for i, (t, p, k, r) in enumerate([(0.3, 1.0, 0, 1.0), (0.5, 0.9, 0, 1.0), (0.4, 1.0, 20, 1.1),
                                          (0.2, 0.95, 0, 1.0), (0.0, 1.0, 0, 1.2), (0.3, 1.0, 0, 1.0)])
    ]
    reference = make_engine(tiny_checkpoint)
    for i, prompt in enumerate(MIXED):
        reference.add_request(f"r{i}", prompt, params[i])
    expected = finals(drain(reference))
    engine = _spec_engine(tiny_checkpoint, method=method)
    for i, prompt in enumerate(MIXED):
        engine.add_request(f"r{i}", prompt, params[i])
    got = finals(drain(engine))
    for r, out in expected.items():
        assert got[r].token_ids == out.token_ids, r
        # The target's logprobs; a verification computes them in a multi-token pass, so the last bits may differ.
        for g, e in zip(got[r].logprobs, out.logprobs, strict=True):
            assert (g.token_id, g.rank, [t for t, _ in g.top]) == (e.token_id, e.rank, [t for t, _ in e.top]), r
            assert g.logprob == pytest.approx(e.logprob, abs=1e-4), r
    _assert_speculated(engine, greedy=False)
    assert sum(o.stats.spec_num_accepted_tokens for o in got.values()) == engine.stats().spec_decode_num_accepted_tokens
    assert_no_blocks_held(engine)


def test_stop_string_inside_accepted_drafts(tiny_checkpoint) -> None:
    # Find a step that output several tokens, and stop at the first of them: the rest must be dropped.
    probe = _spec_engine(tiny_checkpoint)
    steps = drain_with(probe, MIXED[4], greedy(max_tokens=30))["s"]
    tokens = steps[-1].token_ids
    num_before = 0
    for out in steps:
        if len(out.new_token_ids) >= 2 and probe.tokenizer.decode(tokens[: num_before + 1]).isascii():
            break
        num_before += len(out.new_token_ids)
    else:
        raise AssertionError("no step accepted a draft")
    stop = probe.tokenizer.decode(tokens[: num_before + 1])  # first reached by that step's first token
    expected = finals(drain_with(make_engine(tiny_checkpoint), MIXED[4], greedy(max_tokens=30, stop=[stop])))["s"]
    assert expected.token_ids == tokens[: num_before + 1]
    engine = _spec_engine(tiny_checkpoint)
    got = finals(drain_with(engine, MIXED[4], greedy(max_tokens=30, stop=[stop])))["s"]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, "stop")
    assert engine.stats().num_generation_tokens == len(expected.token_ids)
    assert engine.stats().spec_decode_num_accepted_tokens > 0  # the stopping step output more than the stop
    assert_no_blocks_held(engine)


def drain_with(engine, prompt, params):  # noqa: ANN001, ANN201
    engine.add_request("s", prompt, params)
    return drain(engine)


def test_llm_takes_a_speculative_config_and_reports_acceptance(tiny_model_dir) -> None:
    from engine.llm import LLM
    from tests.engine.tiny_model import TINY_ENGINE

    spec = {**NGRAM, "policy": "fixed"}
    llm = LLM(model=str(tiny_model_dir), speculative_config=spec, **TINY_ENGINE)  # type: ignore[arg-type]
    [out] = llm.generate([MIXED[5]], greedy(max_tokens=24))
    assert out.stats.spec_num_draft_tokens >= out.stats.spec_num_accepted_tokens > 0
    assert out.stats.spec_acceptance_rate == out.stats.spec_num_accepted_tokens / out.stats.spec_num_draft_tokens
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "ngram", "k": 3}, **TINY_ENGINE)


def test_speculative_config_flag_reaches_the_engine_config() -> None:
    import argparse
    import dataclasses

    from engine.config import EngineConfig
    from engine.engine_args import add_engine_args, engine_config_from_args
    from engine.config import SpeculativeConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                      '"prompt_lookup_min": 2, "prompt_lookup_max": 4}'])
    config = engine_config_from_args(args)
    assert config.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4, policy="dynamic"
    )
    # `generate` builds LLM(**asdict(config)): the nested config survives the round trip.
    assert EngineConfig(**dataclasses.asdict(config)) == config
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None
    for bad in ('{"method": "medusa"}', "not json", '{"method": "ngram", "policy": "sometimes"}',
                '{"method": "layer_skip"}', '{"method": "ngram", "num_speculative_tokens": 0}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])


def test_generate_command_speculates_with_the_same_output(tiny_model_dir, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from deploy.cli import main
    from tests.engine.tiny_model import TINY_ENGINE

    flags = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hello world Hello world Hello",
             "--temperature", "0", "--max-tokens", "20", "--ignore-eos", "--json",
             *[f"--{name.replace('_', '-')}={value}" for name, value in TINY_ENGINE.items()]]
    assert main(flags) == 0
    plain = capsys.readouterr().out
    assert main([*flags, "--speculative-config", json.dumps({**NGRAM, "policy": "fixed"})]) == 0
    assert capsys.readouterr().out == plain
    assert len(json.loads(plain)["token_ids"]) == 20
