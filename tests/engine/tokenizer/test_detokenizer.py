"""IncrementalDetokenizer and StopChecker: streaming equals decode, half characters and stop strings held back."""

from __future__ import annotations

import random

import pytest

from engine.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker
from engine.tokenizer.tokenizer import Tokenizer
from tests.engine.tokenizer.corpus import CORPUS

MULTIBYTE = "Emoji 😀👍🏽🇯🇵 and 日本語のテキスト, ZWJ 👩‍👩‍👧, café"


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add_token(token_id) for token_id in ids] + [detokenizer.finish()]


def test_multibyte_characters_span_tokens(smollm_like: Tokenizer) -> None:
    # Guard: the small vocabulary really cuts characters, so the streaming tests below are not vacuous.
    ids = smollm_like.encode(MULTIBYTE)
    assert any("\ufffd" in smollm_like.decode([token_id]) for token_id in ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streaming_concatenates_to_decode(smollm_like: Tokenizer, skip_special_tokens: bool) -> None:
    for text in [*CORPUS, MULTIBYTE]:
        ids = smollm_like.encode(text)
        deltas = stream(IncrementalDetokenizer(smollm_like, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(deltas) == smollm_like.decode(ids, skip_special_tokens=skip_special_tokens)
        assert all("\ufffd" not in delta for delta in deltas)  # never half a character


def test_every_truncation_streams_to_decode(smollm_like: Tokenizer) -> None:
    # Generation can stop anywhere, including mid-character: the flushed stream still equals decode.
    ids = smollm_like.encode(MULTIBYTE)
    for num_ids in range(len(ids) + 1):
        deltas = stream(IncrementalDetokenizer(smollm_like), ids[:num_ids])
        assert "".join(deltas) == smollm_like.decode(ids[:num_ids])
        assert all("\ufffd" not in delta for delta in deltas[:-1])


def test_cut_character_at_the_end_is_flushed_as_replacement(smollm_like: Tokenizer) -> None:
    ids = smollm_like.encode("ok 😀")
    cut = next(n for n in range(len(ids), 0, -1) if smollm_like.decode(ids[:n]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(smollm_like)
    assert "".join(detokenizer.add_token(token_id) for token_id in ids[:cut]) == "ok "
    assert detokenizer.finish() == "\ufffd" and detokenizer.text == smollm_like.decode(ids[:cut])


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected"),
    [
        ("Hello world, said the fox.", ["Hello"], False, ""),  # stop at the very start
        ("Hello world, said the fox.", ["world, said"], False, "Hello "),  # spans several tokens
        ("Hello world, said the fox.", ["world, said"], True, "Hello world, said"),
        ("Hello world, said the fox.", ["fox", "said"], False, "Hello world, "),  # the earliest stop wins
        ("12345 and 3.14159", ["3.14"], False, "12345 and "),
        ("Emoji 😀👍🏽 end", ["👍"], False, "Emoji 😀"),  # stop made of a multi-token character
        ("Hello world", ["xyz"], False, "Hello world"),  # no stop
    ],
)
def test_stop_strings(smollm_like: Tokenizer, text: str, stop: list[str], include: bool, expected: str) -> None:
    ids = smollm_like.encode(text)
    detokenizer = IncrementalDetokenizer(smollm_like, stop=stop, include_stop_str_in_output=include)
    assert "".join(stream(detokenizer, ids)) == expected
    assert detokenizer.text == expected
    assert detokenizer.stopped == (expected != text)


def test_partial_stop_string_is_held_then_released(smollm_like: Tokenizer) -> None:
    text = "the end is near, the end."
    detokenizer = IncrementalDetokenizer(smollm_like, stop=["the end!"])
    streamed = ""
    num_checks = 0
    for token_id in smollm_like.encode(text):
        streamed += detokenizer.add_token(token_id)
        if detokenizer.text.endswith(("the", "the end")):  # a possible start of "the end!": none of it is out
            assert streamed == detokenizer.text[: detokenizer.text.rindex("the")]
            num_checks += 1
    assert num_checks >= 2
    assert streamed + detokenizer.finish() == text and not detokenizer.stopped


def test_streamed_text_is_never_retracted(smollm_like: Tokenizer) -> None:
    # Random stop strings taken from the text itself: every streamed prefix must be a prefix of the final output.
    rng = random.Random(0)
    texts = [t for t in [*CORPUS, MULTIBYTE] if len(t) > 4]
    for _ in range(200):
        text = rng.choice(texts)
        start = rng.randrange(len(text) - 2)
        stop = text[start : start + rng.randint(1, 6)]
        include = rng.random() < 0.5
        ids = smollm_like.encode(text, add_special_tokens=False)
        full = smollm_like.decode(ids)
        cut = full.find(stop)
        expected = full if cut == -1 else full[: cut + len(stop) if include else cut]
        detokenizer = IncrementalDetokenizer(smollm_like, stop=[stop], include_stop_str_in_output=include)
        streamed = ""
        for token_id in ids:
            streamed += detokenizer.add_token(token_id)
            assert expected.startswith(streamed), (text, stop)
        assert streamed + detokenizer.finish() == expected, (text, stop)
        if detokenizer.stopped:
            assert detokenizer.add_token(ids[0]) == ""  # ignored after the stop


def test_stop_checker_unit() -> None:
    checker = StopChecker(["abc", "xy"])
    assert checker.num_held_chars("zzab") == 2
    assert checker.num_held_chars("zzx") == 1
    assert checker.num_held_chars("zza") == 1
    assert checker.num_held_chars("zzabz") == 0
    assert checker.find("zzab", 2) is None
    match = checker.find("zzabcq", 2)
    assert match is not None and match.stop_str == "abc" and match.text == "zz"
    assert StopChecker(["abc"], include_stop_str_in_output=True).find("zzabcq", 2).text == "zzabc"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker([""])
