"""Pre-tokenizer: cuts text into the words that byte-level BPE then merges within.

A pre-tokenizer is a sequence of regex stages. Each stage splits every piece the previous stage produced,
keeping both the matches and the text between them ("isolated" splitting, as in HF `Split(behavior=
"isolated")` and llama.cpp's `regex_exprs`). One shape covers every byte-level family we serve:

    gpt2       [GPT-2 regex]                    HF ByteLevel(use_regex=True)
    smollm     [\\p{N}, GPT-2 regex]             HF Sequence[Digits(individual_digits=True), ByteLevel]
    llama-bpe  [Llama-3 regex]                  HF Sequence[Split(Llama-3 regex), ByteLevel(use_regex=False)]
    qwen2      [Qwen2 regex]                    likewise, digits one at a time

Patterns are written for the `regex` package, which knows `\\p{L}`/`\\p{N}` and scoped flags like `(?i:...)`,
so the same strings work as in HF's Oniguruma-based `tokenizers` and in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SINGLE_DIGIT_PATTERN = r"\p{N}"  # HF Digits(individual_digits=True): Rust's char::is_numeric is Unicode N*
DIGIT_RUN_PATTERN = r"\p{N}+"  # HF Digits(individual_digits=False)

# GGUF `tokenizer.ggml.pre` names (llama.cpp's spelling) -> stages. A missing key means "default" (GPT-2).
PRE_TOKENIZER_STAGES: dict[str, tuple[str, ...]] = {
    "default": (GPT2_PATTERN,),
    "gpt2": (GPT2_PATTERN,),
    "gpt-2": (GPT2_PATTERN,),
    "smollm": (SINGLE_DIGIT_PATTERN, GPT2_PATTERN),
    "llama-bpe": (LLAMA3_PATTERN,),
    "llama3": (LLAMA3_PATTERN,),
    "llama-v3": (LLAMA3_PATTERN,),
    "qwen2": (QWEN2_PATTERN,),
    "deepseek-r1-qwen": (QWEN2_PATTERN,),
}


def stages_for_name(name: str | None) -> tuple[str, ...]:
    """The regex stages for a GGUF pre-tokenizer name; ValueError naming it when we do not know it.

    Guessing GPT-2 for an unknown name would tokenize differently from the model's training without any
    visible error, so we refuse instead.
    """
    key = "default" if name is None else name
    if key not in PRE_TOKENIZER_STAGES:
        raise ValueError(
            f"unsupported pre-tokenizer {name!r}; supported: {sorted(PRE_TOKENIZER_STAGES)}"
        )
    return PRE_TOKENIZER_STAGES[key]


class PreTokenizer:
    """Splits a text segment (no special tokens inside) into words, in order; their concatenation is the input."""

    def __init__(self, stages: Sequence[str]) -> None:
        if not stages:
            raise ValueError("a pre-tokenizer needs at least one regex stage")
        self.stages: tuple[str, ...] = tuple(stages)
        self._patterns = [regex.compile(pattern) for pattern in self.stages]

    def split(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for pattern in self._patterns:
            next_pieces: list[str] = []
            for piece in pieces:
                _split_isolated(pattern, piece, next_pieces)
            pieces = next_pieces
        return pieces

    def __repr__(self) -> str:
        return f"PreTokenizer(stages={self.stages!r})"


def _split_isolated(pattern: regex.Pattern[str], text: str, out: list[str]) -> None:
    """Append to `out` the non-empty matches of `pattern` in `text` and the non-empty gaps between them."""
    position = 0
    for match in pattern.finditer(text):
        start, end = match.span()
        if start > position:
            out.append(text[position:start])
        if end > start:
            out.append(text[start:end])
        position = end
    if position < len(text):
        out.append(text[position:])
