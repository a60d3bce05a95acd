"""Reading a `TokenizerSpec` out of a GGUF file's metadata (llama.cpp's `tokenizer.*` keys).

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported; SentencePiece ("llama"),
WordPiece ("bert") and others are refused by name.

Speed: `GGUFReader` already splits every array into one numpy view per element, so we read each token with one
`tobytes()` and never go through `ReaderField.contents()`: 49k tokens, merges and types take ~0.1 s. Opening the
reader itself costs more (~3 s for SmolLM2, all in gguf's field parsing), which is why a reader the weight loader
already opened can be passed instead of a path.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.tokenizer.bpe import AddedToken
from engine.tokenizer.pre_tokenizer import LLAMA3_PATTERN, stages_for_name
from engine.tokenizer.spec import TokenizerSpec

if TYPE_CHECKING:
    from gguf import GGUFReader

# llama.cpp's llama_token_type values (gguf.TokenType).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def spec_from_gguf(source: str | os.PathLike[str] | GGUFReader) -> TokenizerSpec:
    """The tokenizer a GGUF file describes; ValueError naming the problem when it is not one we can run."""
    from gguf import GGUFReader  # numpy-only, but keep the import cost off code paths that never see a GGUF

    reader = source if isinstance(source, GGUFReader) else GGUFReader(source)
    where = str(getattr(reader.data, "filename", None) or source)
    fields = _Fields(reader, where)

    model = fields.string("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{where}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported "
            "(SentencePiece 'llama', 'bert', ... are not)"
        )
    tokens = fields.strings("tokenizer.ggml.tokens")
    merges = tuple(_split_merge(merge, where) for merge in fields.strings("tokenizer.ggml.merges"))
    token_types = fields.int_array("tokenizer.ggml.token_type", default=np.ones(len(tokens), dtype=np.int32))
    if len(token_types) != len(tokens):
        raise ValueError(f"{where}: {len(token_types)} token types for {len(tokens)} tokens")

    added_tokens = tuple(
        AddedToken(content=tokens[token_id], id=token_id, special=token_type == TOKEN_TYPE_CONTROL)
        for token_id, token_type in enumerate(token_types.tolist())
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    )
    stages = stages_for_name(fields.optional_string("tokenizer.ggml.pre"))
    bos_id = fields.optional_int("tokenizer.ggml.bos_token_id")
    eos_id = fields.optional_int("tokenizer.ggml.eos_token_id")
    # A missing flag means "no": that is what transformers' GGUF loader does for byte-level vocabularies.
    add_bos = bool(fields.optional_int("tokenizer.ggml.add_bos_token") or False)
    add_eos = bool(fields.optional_int("tokenizer.ggml.add_eos_token") or False)
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    return TokenizerSpec(
        vocab=vocab,
        id_to_token=dict(enumerate(tokens)) if len(vocab) < len(tokens) else None,
        merges=merges,
        pre_tokenizer_stages=stages,
        added_tokens=added_tokens,
        # llama.cpp skips merging a Llama-3 word that is already a token, as HF's tokenizer.json says to.
        ignore_merges=stages == (LLAMA3_PATTERN,),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        prefix_token_ids=(bos_id,) if add_bos and bos_id is not None else (),
        suffix_token_ids=(eos_id,) if add_eos and eos_id is not None else (),
        chat_template=fields.optional_string("tokenizer.chat_template"),
        source=where,
    )


def _split_merge(merge: str, where: str) -> tuple[str, str]:
    # Byte-level tokens never contain a real space (it is spelled 'Ġ'), so the one space separates the pair.
    first, space, second = merge.partition(" ")
    if not space:
        raise ValueError(f"{where}: malformed merge {merge!r}")
    return first, second


class _Fields:
    """Typed access to a reader's metadata, going through `parts`/`data` directly rather than per-element."""

    def __init__(self, reader: GGUFReader, where: str) -> None:
        self._fields = reader.fields
        self._where = where

    def _field(self, key: str) -> Any:
        field = self._fields.get(key)
        if field is None:
            raise ValueError(f"{self._where}: GGUF has no {key!r}")
        return field

    def string(self, key: str) -> str:
        field = self._field(key)
        return bytes(field.parts[field.data[0]]).decode("utf-8")

    def optional_string(self, key: str) -> str | None:
        return self.string(key) if key in self._fields else None

    def optional_int(self, key: str) -> int | None:
        if key not in self._fields:
            return None
        field = self._fields[key]
        return int(field.parts[field.data[0]][0])

    def strings(self, key: str) -> list[str]:
        field = self._field(key)
        parts = field.parts
        return [parts[index].tobytes().decode("utf-8") for index in field.data]

    def int_array(self, key: str, default: np.ndarray) -> np.ndarray:
        if key not in self._fields:
            return default
        field = self._fields[key]
        if not field.data:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([field.parts[index] for index in field.data])
