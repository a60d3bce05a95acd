"""TokenizerSpec: everything a `Tokenizer` needs, read out of a model's files by a factory.

Configs do no I/O (house style): `gguf_spec.spec_from_gguf` and `hf_spec.spec_from_hf_dir` read files and
return one of these; `Tokenizer(spec)` only builds from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.tokenizer.bpe import AddedToken


@dataclass(frozen=True, kw_only=True, eq=False)
class TokenizerSpec:
    vocab: Mapping[str, int]  # byte-level spelling -> id
    id_to_token: Mapping[int, str] | None = None  # only needed when ids share a spelling; else vocab's inverse
    merges: tuple[tuple[str, str], ...]  # ranked: earlier merges apply first
    pre_tokenizer_stages: tuple[str, ...]  # regexes, see pre_tokenizer.py
    added_tokens: tuple[AddedToken, ...] = ()
    normalization: str | None = None  # a unicodedata form, e.g. "NFC" (Qwen2)
    ignore_merges: bool = False  # Llama-3: a whole word found in the vocabulary is taken as is
    unk_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # More ids that end generation, e.g. HF generation_config.json's eos list; eos_token_id is not repeated here.
    extra_eos_token_ids: tuple[int, ...] = ()
    # Ids that encode(add_special_tokens=True) puts around the text, e.g. (bos,) when the model adds BOS.
    prefix_token_ids: tuple[int, ...] = ()
    suffix_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    source: str = ""  # where it was read from, for error messages
