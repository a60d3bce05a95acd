"""`Tokenizer.from_gguf`: synthetic GGUFs written in-test, and the real SmolLM2 GGUF against transformers."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer.detokenizer import IncrementalDetokenizer
from engine.tokenizer.gguf_spec import spec_from_gguf
from engine.tokenizer.tokenizer import Tokenizer
from tests.engine.tokenizer.corpus import CHAT_TEMPLATE, CORPUS

MESSAGES = [
    {"role": "user", "content": "Hi there! What's 12345 * 3.14159?"},
    {"role": "assistant", "content": "About 38785.\n\n  Anything else? 😀"},
    {"role": "user", "content": "日本語で <|im_start|> please"},
]
# variant -> the `tokenizer.ggml.pre` llama.cpp writes for that family. (qwen2 is left out: HF normalizes it with
# NFC, a GGUF cannot say so, and llama.cpp does not normalize; gpt2-bos has an lstrip token a GGUF cannot express.)
GGUF_PRE = {"smollm": "smollm", "llama3": "llama-bpe"}


def write_gguf(
    path: Path, *, model: str = "gpt2", pre: str | None = None, reference: HFTokenizer | None = None
) -> Path:
    """A GGUF holding only tokenizer metadata, from a trained HF tokenizer (ids in order, specials as CONTROL)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if reference is None:
        tokens = ["<unk>", "<s>", "</s>", "\u2581a"]
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types([2, 3, 3, 1])
    else:
        vocab = reference.get_vocab(with_added_tokens=True)
        tokens = sorted(vocab, key=vocab.__getitem__)
        added = reference.get_added_tokens_decoder()
        types = [
            (3 if added[i].special else 4) if i in added else 1  # CONTROL, USER_DEFINED, NORMAL
            for i in range(len(tokens))
        ]
        merges = json.loads(reference.to_str())["model"]["merges"]
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges([" ".join(pair) for pair in merges])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant", sorted(GGUF_PRE))
def test_synthetic_gguf_matches_hf_tokenizers(variant: str, trained: dict[str, HFTokenizer], tmp_path: Path) -> None:
    reference = trained[variant]
    ours = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre=GGUF_PRE[variant], reference=reference))
    assert ours.bos_token_id == 0 and ours.eos_token_ids == (2,)
    for text in CORPUS:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.encode(text) == [0, *expected]  # tokenizer.ggml.add_bos_token = true
        for skip in (True, False):
            assert ours.decode(expected, skip_special_tokens=skip) == reference.decode(expected, skip)
    prompt = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sentencepiece_gguf_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama.gguf", model="llama")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model is 'llama'.*only byte-level BPE \('gpt2'\)"):
        Tokenizer.from_gguf(path)


def test_unknown_pre_tokenizer_is_refused(trained: dict[str, HFTokenizer], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", pre="mystery-bpe", reference=trained["smollm"])
    with pytest.raises(ValueError, match="unsupported pre-tokenizer 'mystery-bpe'"):
        Tokenizer.from_gguf(path)


# -- the real SmolLM2 GGUF --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_reader(smol_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smol_gguf)  # opening parses every field (~3 s here); the weight loader shares it


@pytest.fixture(scope="module")
def smol(smol_reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf(smol_reader)


@pytest.fixture(scope="module")
def smol_hf(smol_gguf: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)


@pytest.fixture(scope="module")
def smol_hf_published(smol_hf: Any) -> Any:
    """transformers' tokenizer with SmolLM2's published pre-tokenizer put back.

    transformers rebuilds a GGUF "gpt2" vocabulary with plain ByteLevel and has no split for pre "smollm", so it
    drops the Digits step of SmolLM2's tokenizer.json. llama.cpp keeps it (`\\p{N}` first), and so do we.
    """
    from tokenizers import pre_tokenizers

    hf = copy.deepcopy(smol_hf)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return hf


def test_smol_fields(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1 and smol.eos_token_id == 2 and smol.eos_token_ids == (2,)
    assert set(range(17)) == smol.special_token_ids
    assert smol.encode("Hello") == smol.encode("Hello", add_special_tokens=False)  # add_bos_token is false


def test_smol_encode_decode_match_hf(smol: Tokenizer, smol_hf_published, smol_hf) -> None:
    for text in CORPUS:
        expected = smol_hf_published.encode(text)
        assert smol.encode(text) == expected, text
        if not any(char.isdigit() for char in text):
            assert smol.encode(text) == smol_hf.encode(text), text  # unpatched transformers agrees without digits
        for skip in (True, False):
            assert smol.decode(expected, skip_special_tokens=skip) == smol_hf.decode(expected, skip_special_tokens=skip)


def test_smol_digits_follow_the_published_tokenizer(smol: Tokenizer, smol_hf) -> None:
    # The one place unpatched transformers differs: whitespace before a digit. llama.cpp and SmolLM2's
    # tokenizer.json split the digit off first, so the spaces stay one "ĠĠ" token.
    assert smol.encode("x  1") == [104, 256, 33]
    assert smol_hf.encode("x  1") == [104, 216, 216, 33]


def test_smol_chat_template_matches_hf(smol: Tokenizer, smol_hf) -> None:
    for add_generation_prompt in (True, False):
        expected = smol_hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert smol.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected
    # continue_final_message: the prompt ends inside the last (assistant) message, as HF cuts it
    partial = [*MESSAGES, {"role": "assistant", "content": "  Sure: 日本語 "}]
    expected = smol_hf.apply_chat_template(partial, tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True)
    ours = smol.apply_chat_template(partial, add_generation_prompt=False, continue_final_message=True)
    assert ours == expected and ours.endswith("assistant\n  Sure: 日本語 ")  # its spacing kept, as HF keeps it
    with pytest.raises(ValueError, match="cannot both be true"):
        smol.apply_chat_template(partial, continue_final_message=True)


def test_smol_streaming_matches_decode(smol: Tokenizer) -> None:
    for text in CORPUS:
        ids = smol.encode(text)
        detokenizer = IncrementalDetokenizer(smol)
        streamed = "".join(detokenizer.add_token(token_id) for token_id in ids) + detokenizer.finish()
        assert streamed == smol.decode(ids)


def test_smol_token_list_reads_fast(smol_reader: gguf.GGUFReader) -> None:
    start_s = time.perf_counter()
    spec = spec_from_gguf(smol_reader)
    elapsed_s = time.perf_counter() - start_s
    assert len(spec.vocab) == 49152 and len(spec.merges) == 48900
    assert elapsed_s < 2.0, f"reading 49k tokens and merges took {elapsed_s:.2f} s"
