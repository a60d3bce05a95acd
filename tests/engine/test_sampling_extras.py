"""n > 1, logit_bias and prompt_logprobs through the real engine (tiny random-weight model): reproducible,
distinct seeded choices whose prompt blocks are counted once and all returned after success and abort; a bias
that removes the greedy token or forces one; prompt logprobs equal to the model's own log-softmax over the
prompt, whether the prompt runs whole or in chunks, with the prefix cache skipped."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.tiny_model import BlockRefCounter, assert_no_blocks_held, drain, finals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPT = list(range(3, 13))  # 10 tokens: two full blocks of 4 shared, two tokens each choice recomputes


def _choices(engine, request_id: str, params: SamplingParams) -> dict[int, list[int]]:
    engine.add_request(request_id, PROMPT, params)
    outs = finals(drain(engine))
    return {out.index: out.token_ids for out in outs.values()}


def test_n_choices_are_seeded_distinct_reproducible_and_their_prompt_blocks_counted_once(tiny_checkpoint) -> None:
    params = {"n": 4, "temperature": 1.0, "seed": 123, "max_tokens": 6, "ignore_eos": True}
    engine = make_engine(tiny_checkpoint)
    counter = BlockRefCounter(engine)
    engine.add_request("r", PROMPT, SamplingParams(**params))
    engine.step()  # choice 0 computes the prompt (10 tokens: blocks 0-2) and forks the other three
    assert engine.block_pool.num_used_blocks == 3
    engine.step()  # each choice recomputes t8 t9 into a block of its own; blocks 0 and 1 held by all four
    assert engine.block_pool.num_used_blocks == 2 + 4
    assert [engine.block_pool.blocks[b].ref_cnt for b in engine.kv_cache.block_ids("r")[:2]] == [4, 4]
    outs = finals(drain(engine))
    assert sorted(outs) == ["r", "r#1", "r#2", "r#3"] and sorted(o.index for o in outs.values()) == [0, 1, 2, 3]
    choices = {out.index: out.token_ids for out in outs.values()}
    assert len({tuple(t) for t in choices.values()}) == 4  # distinct seeds, distinct samples
    assert_no_blocks_held(engine)
    counter.assert_balanced()

    assert _choices(make_engine(tiny_checkpoint), "again", SamplingParams(**params)) == choices
    # choice i samples as a single request seeded seed + i would
    single = _choices(make_engine(tiny_checkpoint), "one", SamplingParams(**{**params, "n": 1, "seed": 125}))
    assert single[0] == choices[2]


def test_best_of_generates_best_of_sequences(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint)
    choices = _choices(engine, "b", SamplingParams(n=1, best_of=3, temperature=1.0, seed=1, max_tokens=3, logprobs=0))
    assert sorted(choices) == [0, 1, 2]
    assert_no_blocks_held(engine)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "policy": "fixed"}
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"}


@pytest.mark.parametrize("method", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_choices_and_logit_bias_are_unchanged_by_speculation(tiny_checkpoint, method: dict) -> None:
    params = {"n": 3, "temperature": 0.8, "seed": 7, "max_tokens": 12, "ignore_eos": True,
              "logit_bias": {5: 3.0, 9: -2.0}}
    plain = _choices(make_engine(tiny_checkpoint), "r", SamplingParams(**params))
    if method["method"] == "draft_model":
        method = {**method, "model": str(tiny_checkpoint.path)}
    engine = make_engine(tiny_checkpoint, speculative_config=method)
    counter = BlockRefCounter(engine)
    assert _choices(engine, "r", SamplingParams(**params)) == plain
    assert engine.stats().spec_decode_num_draft_tokens > 0, "nothing was speculated"
    assert_no_blocks_held(engine)
    counter.assert_balanced()


@pytest.mark.parametrize("when", ["before_fork", "after_fork"])
def test_abort_ends_every_choice_and_frees_every_block(tiny_checkpoint, when: str) -> None:
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=4)  # the prompt takes three steps
    counter = BlockRefCounter(engine)
    engine.add_request("r", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True))
    for _ in range(1 if when == "before_fork" else 5):
        engine.step()
    assert engine.block_pool.num_used_blocks > 0
    outs = engine.abort_request(["r"])
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("r", "abort"), ("r#1", "abort"),
                                                                       ("r#2", "abort")]
    assert_no_blocks_held(engine)
    counter.assert_balanced()


def test_logit_bias_removes_the_greedy_token_and_forces_another(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint)
    engine.add_request("plain", PROMPT, greedy(max_tokens=4))
    plain = finals(drain(engine))["plain"].token_ids
    engine.add_request("banned", PROMPT, greedy(max_tokens=4, logit_bias={plain[0]: -100.0}))
    banned = finals(drain(engine))["banned"].token_ids
    assert plain[0] not in banned
    forced_id = next(t for t in range(5, 30) if t not in plain)
    engine.add_request("forced", PROMPT, greedy(max_tokens=4, logit_bias={forced_id: 100.0}))
    assert finals(drain(engine))["forced"].token_ids == [forced_id] * 4
    with pytest.raises(ValueError, match="logit_bias token ids out of range"):
        engine.add_request("bad", PROMPT, greedy(logit_bias={10**6: 1.0}))
    assert_no_blocks_held(engine)


def test_allowed_token_ids_keep_every_token_within_them(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint)
    engine.add_request("plain", PROMPT, greedy(max_tokens=6))
    plain = finals(drain(engine))["plain"].token_ids
    allowed = [t for t in range(5, 30) if t not in plain][:3]
    engine.add_request("greedy", PROMPT, greedy(max_tokens=6, allowed_token_ids=allowed))
    engine.add_request("sampled", PROMPT, SamplingParams(temperature=1.5, seed=4, max_tokens=6, ignore_eos=True,
                                                         allowed_token_ids=allowed))
    outs = finals(drain(engine))
    assert set(outs["greedy"].token_ids) <= set(allowed) and set(outs["sampled"].token_ids) <= set(allowed)
    eos = engine.tokenizer.eos_token_ids[0]
    for params, message in ((greedy(allowed_token_ids=[10**6]), "allowed_token_ids out of range"),
                            (greedy(allowed_token_ids=[eos], min_tokens=2), "nothing would be left to sample")):
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", PROMPT, params)
    assert_no_blocks_held(engine)


def _reference_prompt_logprobs(engine, prompt: list[int]) -> torch.Tensor:
    """log p(t_j | t_<j) for j >= 1, from one plain prefill of a throwaway engine on the same weights."""
    from engine.core.scheduler import ScheduledRequest
    from engine.model_runner import prepare_step

    request = engine.make_request("ref", prompt, greedy(max_tokens=1))
    assert engine.kv_cache.allocate_slots(request, len(prompt))
    item = ScheduledRequest(request=request, start=0, num_new_tokens=len(prompt),
                            block_ids=engine.kv_cache.block_ids("ref"), samples=True)
    input_ids, positions, meta = prepare_step([item], engine.kv_cache.block_size)
    runner = engine.runner
    hidden = runner.model.forward(input_ids, positions, runner.kv_caches, meta)
    logprobs = runner.model.compute_logits(hidden).log_softmax(dim=-1)  # [P, vocab]
    return logprobs[:-1].gather(-1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("max_num_batched_tokens", [256, 4])
def test_prompt_logprobs_are_the_models_own_and_skip_the_prefix_cache(tiny_checkpoint,
                                                                      max_num_batched_tokens: int) -> None:
    prompt = list(range(3, 22))  # 19 tokens: 18 prompt logprobs
    expected = _reference_prompt_logprobs(make_engine(tiny_checkpoint), prompt)
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=max_num_batched_tokens)
    engine.add_request("warm", prompt, greedy(max_tokens=1))  # its blocks become prefix cache
    drain(engine)
    engine.add_request("p", prompt, greedy(max_tokens=2, prompt_logprobs=2))
    outs = drain(engine)["p"]
    first = outs[0]
    assert first.prompt_logprobs is not None and [o.prompt_logprobs for o in outs[1:]] == [None] * (len(outs) - 1)
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]
    got = torch.tensor([lp.logprob for lp in first.prompt_logprobs])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert all(len(lp.top) == 2 and lp.rank >= 1 for lp in first.prompt_logprobs)
    assert outs[-1].stats is not None and outs[-1].stats.num_cached_tokens == 0  # no prefix hit for this one
    assert_no_blocks_held(engine)


def _holds(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(sequence)]) == sequence for i in range(len(tokens) - len(sequence) + 1))


def _word_in(engine, tokens: list[int]) -> tuple[str, list[tuple[int, ...]]]:
    """A word of two or more tokens that `tokens` hold (its ban has to read the output), and its sequences."""
    from engine.request.bad_words import bad_words_token_ids

    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)

    for i in range(len(tokens) - 2):
        word = engine.tokenizer.decode(tokens[i:i + 3])
        if word.strip():
            sequences = bad_words_token_ids([word], encode)
            if any(len(s) > 1 and _holds(tokens, s) for s in sequences):
                return word, sequences
    raise AssertionError(f"no multi-token word in {tokens}")


SAMPLED = {"temperature": 0.9, "seed": 3, "ignore_eos": True, "max_tokens": 16}


@pytest.mark.parametrize("mode", ["sync", "async", "ngram"])
def test_bad_words_never_complete_in_the_output(tiny_checkpoint, mode: str) -> None:
    overrides = {"async_scheduling": True} if mode == "async" else {}
    if mode == "ngram":
        overrides = {"speculative_config": NGRAM}
    engine = make_engine(tiny_checkpoint, **overrides)
    counter = BlockRefCounter(engine)
    engine.add_request("greedy", PROMPT, greedy(max_tokens=16))
    engine.add_request("sampled", PROMPT, SamplingParams(**SAMPLED))
    plain = {name: out.token_ids for name, out in finals(drain(engine)).items()}
    words = {name: _word_in(engine, tokens) for name, tokens in plain.items()}
    engine.add_request("greedy", PROMPT, greedy(max_tokens=16, bad_words=[words["greedy"][0]]))
    engine.add_request("sampled", PROMPT, SamplingParams(**SAMPLED, bad_words=[words["sampled"][0]]))
    outs = finals(drain(engine))
    for name, (word, sequences) in words.items():
        assert not any(_holds(outs[name].token_ids, s) for s in sequences), (name, word, sequences)
        assert outs[name].token_ids != plain[name]
    if mode == "ngram":
        assert engine.stats().spec_decode_num_draft_tokens > 0, "nothing was speculated"
    word, sequences = words["greedy"]
    with pytest.raises(ValueError, match="nothing would be left"):
        engine.add_request("bad", PROMPT, greedy(allowed_token_ids=[sequences[0][-1]], bad_words=[word]))
    assert_no_blocks_held(engine)
    counter.assert_balanced()


def test_bad_words_give_the_same_tokens_with_async_scheduling_and_speculation(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint)
    engine.add_request("g", PROMPT, greedy(max_tokens=16))
    engine.add_request("s", PROMPT, SamplingParams(**SAMPLED))
    words = [_word_in(engine, out.token_ids)[0] for out in finals(drain(engine)).values()]
    runs = []
    for overrides in ({}, {"async_scheduling": True}, {"speculative_config": NGRAM}):
        engine = make_engine(tiny_checkpoint, **overrides)
        engine.add_request("g", PROMPT, greedy(max_tokens=16, bad_words=words))
        engine.add_request("s", PROMPT, SamplingParams(**SAMPLED, bad_words=words))
        runs.append({k: out.token_ids for k, out in finals(drain(engine)).items()})
    assert runs[0] == runs[1] == runs[2]
