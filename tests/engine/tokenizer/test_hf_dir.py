"""`Tokenizer.from_hf_dir` against HF `tokenizers` on synthetic models of each supported shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer.tokenizer import Tokenizer
from tests.engine.tokenizer.corpus import CORPUS, VARIANTS

MESSAGES = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Hi 😀 what is 12+30?"},
    {"role": "assistant", "content": "42."},
    {"role": "user", "content": "<|im_start|> is literal here"},
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_decode_match_hf_tokenizers(variant: str, trained: dict[str, HFTokenizer], hf_dirs: dict[str, Path]) -> None:
    reference = trained[variant]
    ours = Tokenizer.from_hf_dir(hf_dirs[variant])
    for text in CORPUS:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens).ids
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, (variant, text)
        ids = reference.encode(text).ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_the_corpus_exercises_merges_and_specials(trained: dict[str, HFTokenizer]) -> None:
    # Guard against a vacuous comparison: merges must fire and special tokens must be matched whole.
    encoding = trained["smollm"].encode("Hello world <|im_start|>")
    assert len(encoding.ids) < len("Hello world ") and encoding.ids[-1] == 1


@pytest.mark.parametrize(
    ("variant", "prefix", "eos_ids"),
    [("smollm", (), (2,)), ("gpt2-bos", (0,), (2,)), ("llama3", (0,), (2,)), ("qwen2", (), (2, 0))],
)
def test_special_ids_and_bos_policy(variant: str, prefix: tuple[int, ...], eos_ids: tuple[int, ...], hf_dirs) -> None:
    ours = Tokenizer.from_hf_dir(hf_dirs[variant])
    assert ours.bos_token_id == 0 and ours.eos_token_id == 2
    assert ours.eos_token_ids == eos_ids
    assert tuple(ours.encode("hi")[: len(prefix)]) == prefix
    assert ours.encode("hi", add_special_tokens=False) == ours.encode("hi")[len(prefix) :]
    assert {0, 1, 2} <= ours.special_token_ids
    assert ours.token_to_id("<think>") not in ours.special_token_ids  # an added token, but not special
    assert ours.vocab_size == 702 + (variant == "gpt2-bos")


def test_config_add_bos_token_overrides_post_processor(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy_dir(hf_dirs["smollm"], tmp_path)
    _edit_json(directory / "tokenizer_config.json", lambda config: config.update(add_bos_token=True))
    assert Tokenizer.from_hf_dir(directory).encode("hi")[0] == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_chat_template_matches_transformers(variant: str, hf_dirs: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_dirs[variant]))
    ours = Tokenizer.from_hf_dir(hf_dirs[variant])
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_jinja_file_wins(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy_dir(hf_dirs["smollm"], tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert Tokenizer.from_hf_dir(directory).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda data: data["model"].update(type="WordPiece"), "only byte-level 'BPE'"),
        (lambda data: data.update(pre_tokenizer={"type": "Metaspace"}), "'Metaspace' is not supported"),
        (lambda data: data.update(pre_tokenizer={"type": "Digits"}), "no ByteLevel step"),
        (lambda data: data.update(normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
        (lambda data: data.update(post_processor={"type": "BertProcessing"}), "'BertProcessing' is not"),
    ],
)
def test_unsupported_structures_are_refused_by_name(edit, message: str, hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy_dir(hf_dirs["smollm"], tmp_path)
    _edit_json(directory / "tokenizer.json", edit)
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_hf_dir(directory)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def _copy_dir(source: Path, destination_root: Path) -> Path:
    destination = destination_root / source.name
    destination.mkdir()
    for file in source.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
