"""vLLM's bad_words: the token sequences a word bans (with and without a leading space), which token each bans
next given the output so far, and the sampler masking exactly those, greedy and sampled alike."""

from __future__ import annotations

import pytest
import torch

from engine.request.sampling_params import SamplingParams
from engine.request.bad_words import bad_words_token_ids, banned_next_tokens, needs_output_context
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import SamplingRow

# A toy tokenizer: a leading space makes a different first token (" cat" -> 10 + ...), as in byte-level BPE.
VOCAB = {"cat": [1], " cat": [2], "hot dog": [3, 4], " hot dog": [5, 4], "sun": [6], " sun": [7, 8]}


def encode(text: str) -> list[int]:
    return VOCAB.get(text, [])


def test_each_word_bans_its_bare_and_its_spaced_form_when_that_is_another_token() -> None:
    assert bad_words_token_ids(["cat", "  hot dog"], encode) == [(1,), (2,), (3, 4), (5, 4)]
    # " sun" is two tokens where "sun" is one: a different word to the tokenizer, not banned with it (vLLM's rule)
    assert bad_words_token_ids(["sun"], encode) == [(6,)]
    with pytest.raises(ValueError, match="has no tokens"):
        bad_words_token_ids(["unknown"], encode)


def test_a_longer_sequence_bans_its_last_token_only_after_the_rest() -> None:
    sequences = [(1,), (3, 4), (9, 3, 5)]
    assert banned_next_tokens(sequences, []) == [1]
    assert banned_next_tokens(sequences, [7, 3]) == [1, 4]
    assert banned_next_tokens(sequences, [9, 3]) == [1, 4, 5]
    assert banned_next_tokens(sequences, [3, 7]) == [1]
    assert not needs_output_context([(1,), (2,)]) and needs_output_context([(1,), (3, 4)])


def test_params_refuse_blank_words_and_a_grammar_beside_them() -> None:
    from engine.request.grammar_spec import GrammarSpec

    with pytest.raises(ValueError, match="more than whitespace"):
        SamplingParams(bad_words=["ok", " \t"]).validate()
    with pytest.raises(ValueError, match="structured outputs"):
        SamplingParams(bad_words=["x"], structured_outputs=GrammarSpec(kind="regex", source="a+")).validate()


def _row(params: SamplingParams, output: list[int], bad: list[tuple[int, ...]]) -> SamplingRow:
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, generator, [], output, (), bad_words_token_ids=bad)


def test_the_sampler_masks_the_banned_tokens_of_each_row_only() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.0, 3.0, 2.0]] * 3)  # argmax 4 everywhere
    bad = [(4,)]
    rows = [
        _row(SamplingParams(temperature=0.0), [], bad),  # 4 banned: 5 next
        _row(SamplingParams(temperature=0.0), [], []),  # no words: untouched by the others'
        _row(SamplingParams(temperature=0.0), [0, 3], [(3, 5), (2, 4)]),  # after 3: 5 banned, 4 is not
    ]
    out = Sampler(seed=0).sample(logits, rows)
    assert out.token_ids == [5, 4, 4]
    assert logits[0, 4] == 3.0  # the caller's logits untouched
    hot = _row(SamplingParams(temperature=5.0, seed=1), [], [(4,), (5,)])
    sampler = Sampler(seed=0)
    draws = {sampler.sample(logits[:1], [hot]).token_ids[0] for _ in range(300)}
    assert draws == {0, 1, 2, 3}  # spread over every token but the banned ones
