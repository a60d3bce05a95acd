"""ByteLevelBPE and PreTokenizer in isolation, on hand-made vocabularies."""

from __future__ import annotations

import pytest

from engine.tokenizer.bpe import BYTE_TO_UNICODE, UNICODE_TO_BYTE, AddedToken, ByteLevelBPE
from engine.tokenizer.pre_tokenizer import PRE_TOKENIZER_STAGES, PreTokenizer, stages_for_name


def test_byte_table_is_gpt2s() -> None:
    assert len(set(BYTE_TO_UNICODE)) == 256 and len(UNICODE_TO_BYTE) == 256
    assert BYTE_TO_UNICODE[ord(" ")] == "Ġ" and BYTE_TO_UNICODE[ord("\n")] == "Ċ"
    assert BYTE_TO_UNICODE[ord("A")] == "A" and BYTE_TO_UNICODE[0] == "Ā"


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("gpt2", "I'm 12345 ok!!  x\n", ["I", "'m", " 12345", " ok", "!!", " ", " x", "\n"]),
        ("smollm", "x  12 ab3", ["x", "  ", "1", "2", " ab", "3"]),
        ("llama-bpe", "12345 HELLO'S\n\n x", ["123", "45", " HELLO", "'S", "\n\n", " x"]),
        ("qwen2", "v12 ok", ["v", "1", "2", " ok"]),
    ],
)
def test_pre_tokenizers(name: str, text: str, words: list[str]) -> None:
    assert PreTokenizer(stages_for_name(name)).split(text) == words


def test_pre_tokenizer_names() -> None:
    assert stages_for_name(None) == PRE_TOKENIZER_STAGES["gpt2"]
    with pytest.raises(ValueError, match="unsupported pre-tokenizer 'nope'"):
        stages_for_name("nope")


def _tiny_bpe(**kwargs) -> ByteLevelBPE:
    symbols = [BYTE_TO_UNICODE[b] for b in range(256)]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    merges = [("a", "a"), ("Ġ", "a"), ("aa", "a"), ("Ġa", "b")]
    for first, second in merges:
        vocab[first + second] = len(vocab)
    return ByteLevelBPE(vocab=vocab, merges=merges, pre_tokenizer=PreTokenizer(stages_for_name("gpt2")), **kwargs)


def test_merges_apply_by_rank_left_to_right() -> None:
    bpe = _tiny_bpe()
    aa, aaa, space_ab = bpe.token_to_id("aa"), bpe.token_to_id("aaa"), bpe.token_to_id("Ġab")
    assert bpe.encode("aaa") == [aaa]  # "a a a" -> "aa a" -> "aaa"
    assert bpe.encode("aaaa") == [aa, aa]  # both ("a","a") pairs merge in one pass, leaving no ("aa","a")
    assert bpe.encode("aaaaa") == [aa, aaa]  # left to right: "aa aa a", then "aa aaa"
    assert bpe.encode(" ab") == [space_ab]
    assert bpe.encode("aaaaa") == [aa, aaa]  # again, from the word cache


def test_added_tokens_longest_first_and_lstrip() -> None:
    added = [
        AddedToken(content="<|im", id=1000, special=True),
        AddedToken(content="<|im_start|>", id=1001, special=True),
        AddedToken(content="<mask>", id=1002, lstrip=True),
    ]
    bpe = _tiny_bpe(added_tokens=added)
    assert bpe.encode("<|im_start|>a") == [1001, ord("a")]
    assert bpe.encode("<|im_x") == [1000, ord("_"), ord("x")]
    assert bpe.encode("a   <mask>") == [ord("a"), 1002]  # lstrip swallows the spaces
    assert bpe.token_bytes(1001) == b"<|im_start|>"
    assert bpe.vocab_size == 1003


def test_token_bytes_outside_the_byte_alphabet_is_utf8() -> None:
    bpe = _tiny_bpe(added_tokens=[AddedToken(content="<think> é", id=500)])
    assert bpe.token_bytes(500) == "<think> é".encode()
    assert bpe.token_bytes(bpe.token_to_id("Ġa")) == b" a"  # type: ignore[arg-type]
    assert bpe.token_bytes(99_999) == b""


def test_ids_sharing_a_spelling_all_decode() -> None:
    bpe = _tiny_bpe(id_to_token={700: "Ġa"})  # a GGUF may list a token twice
    assert bpe.token_bytes(700) == b" a" and bpe.vocab_size == 701


def test_unknown_normalization_refused() -> None:
    with pytest.raises(ValueError, match="unsupported normalization"):
        _tiny_bpe(normalization="Lowercase")
