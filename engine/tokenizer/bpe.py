"""Byte-level BPE: text -> token ids, and token id -> bytes.

Encoding, in order:

    text ──added-token match──▶ [segment | added token id]*        literal, longest first, before anything else
    segment ──normalize (NFC..)──▶ ──pre-tokenizer──▶ words        see pre_tokenizer.py
    word ──utf-8──▶ bytes ──GPT-2 byte→unicode──▶ symbols ──merges by rank──▶ ids

The byte→unicode table (GPT-2's) spells every byte as a printable character, so vocabulary and merge files
stay text. Merges are ranked by their order in the file; the lowest-ranked adjacent pair is merged first.
Results are cached per word, since natural text repeats words heavily.

Thread-safety: `encode` only reads shared state except the word cache, whose dict operations are atomic under
the GIL; a race at worst computes a word twice.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import regex

from engine.tokenizer.pre_tokenizer import PreTokenizer


def byte_to_unicode() -> list[str]:
    """GPT-2's table: index = byte value, value = the one character that spells it.

    Printable Latin-1 bytes spell themselves; the other 68 (controls, space, ...) are shifted to U+0100 and up,
    in byte order, so the space byte 0x20 becomes 'Ġ' (U+0120) and newline 0x0A becomes 'Ċ'.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = [""] * 256
    num_shifted = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + num_shifted)
            num_shifted += 1
    return table


BYTE_TO_UNICODE: list[str] = byte_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {char: byte for byte, char in enumerate(BYTE_TO_UNICODE)}

NormalizationForm = Literal["NFC", "NFD", "NFKC", "NFKD"]
NORMALIZATION_FORMS: tuple[str, ...] = ("NFC", "NFD", "NFKC", "NFKD")


@dataclass(frozen=True, kw_only=True)
class AddedToken:
    """A token matched literally in the text before BPE (GGUF CONTROL/USER_DEFINED, HF `added_tokens`).

    `special` tokens are the ones `decode(skip_special_tokens=True)` drops. `lstrip`/`rstrip` let the token
    swallow the whitespace on its left/right, as HF's flags of the same name do.
    """

    content: str
    id: int
    special: bool = False
    lstrip: bool = False
    rstrip: bool = False


class ByteLevelBPE:
    """A byte-level BPE model. Holds no BOS/EOS policy; that is the `Tokenizer`'s job."""

    def __init__(
        self,
        *,
        vocab: Mapping[str, int],
        merges: Sequence[tuple[str, str]],
        pre_tokenizer: PreTokenizer,
        added_tokens: Sequence[AddedToken] = (),
        normalization: str | None = None,
        ignore_merges: bool = False,
        unk_token_id: int | None = None,
        id_to_token: Mapping[int, str] | None = None,
        max_cached_words: int = 100_000,
    ) -> None:
        """`vocab` maps token strings (byte-level spelling) to ids; added tokens are merged into it.

        `normalization` is a `unicodedata` form ("NFC", "NFKC", ...) applied to text outside added tokens.
        `ignore_merges` (Llama-3): a word that is itself in the vocabulary becomes that one token, unmerged.
        Symbols left outside the vocabulary become `unk_token_id`, or are dropped when it is None (as HF does).
        `id_to_token` defaults to the inverse of `vocab`; pass it when several ids share one spelling (a GGUF
        may list a token twice), so that every id still decodes.
        """
        if normalization is not None and normalization not in NORMALIZATION_FORMS:
            raise ValueError(f"unsupported normalization {normalization!r}")
        self._vocab: dict[str, int] = dict(vocab)
        for token in added_tokens:
            self._vocab[token.content] = token.id
        self._id_to_token: dict[int, str] = {token_id: token for token, token_id in self._vocab.items()}
        if id_to_token is not None:
            self._id_to_token.update(id_to_token)
        self._vocab_size = max(self._id_to_token, default=-1) + 1  # fixed from here on
        # A merge whose result is not a token could never appear in an encoding: drop it rather than fail.
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            if pair not in self._ranks and pair[0] + pair[1] in self._vocab:
                self._ranks[pair] = rank
        self.pre_tokenizer = pre_tokenizer
        self.added_tokens: tuple[AddedToken, ...] = tuple(added_tokens)
        # Longest first: at one position "<|im_start|>" must win over a hypothetical "<|im".
        matchable = sorted((token for token in added_tokens if token.content), key=lambda t: -len(t.content))
        self._added_matcher = _compile_added_matcher(matchable)
        self._added_ids = [token.id for token in matchable]
        self._normalization = cast("NormalizationForm | None", normalization)
        self._ignore_merges = ignore_merges
        self._unk_token_id = unk_token_id
        self._max_cached_words = max_cached_words
        self._word_cache: dict[str, tuple[int, ...]] = {}
        self._bytes_cache: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        """One past the largest id (ids may have gaps)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._id_to_token.get(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`, added tokens included as their single ids; no BOS/EOS."""
        ids: list[int] = []
        for segment, added_id in self._segments(text):
            if added_id is not None:
                ids.append(added_id)
                continue
            if self._normalization is not None:
                segment = unicodedata.normalize(self._normalization, segment)
            for word in self.pre_tokenizer.split(segment):
                ids.extend(self._encode_word(word))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; b"" for an id with no token (HF likewise decodes those to nothing).

        HF's ByteLevel decoder rule: a token spelled wholly in the byte alphabet is mapped back byte by byte;
        any other (an added token like "<think> " with a real space) is its own UTF-8 text.
        """
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        token = self._id_to_token.get(token_id)
        if token is None:
            return b""
        try:
            result = bytes(UNICODE_TO_BYTE[char] for char in token)
        except KeyError:
            result = token.encode("utf-8")
        self._bytes_cache[token_id] = result
        return result

    def _segments(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Cut `text` at added tokens: yields (text, None) for plain segments and ("", id) for added tokens."""
        if self._added_matcher is None:
            if text:
                yield text, None
            return
        position = 0
        for match in self._added_matcher.finditer(text):
            if match.start() > position:
                yield text[position : match.start()], None
            assert match.lastindex is not None  # every alternative is one group
            yield "", self._added_ids[match.lastindex - 1]
            position = match.end()
        if position < len(text):
            yield text[position:], None

    def _encode_word(self, word: str) -> tuple[int, ...]:
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        # latin-1 turns each byte into the code point of the same value, which translate() then respells.
        symbols = word.encode("utf-8").decode("latin-1").translate(BYTE_TO_UNICODE)
        ids = self._merge(symbols)
        if len(self._word_cache) >= self._max_cached_words:
            self._word_cache.clear()  # crude but bounded; a hot working set refills within a few requests
        self._word_cache[word] = ids
        return ids

    def _merge(self, spelled: str) -> tuple[int, ...]:
        vocab = self._vocab
        if self._ignore_merges and spelled in vocab:
            return (vocab[spelled],)
        symbols = list(spelled)
        ranks = self._ranks
        while len(symbols) > 1:
            best_pair: tuple[str, str] | None = None
            best_rank = -1
            for pair in zip(symbols, symbols[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_pair is None or rank < best_rank):
                    best_pair, best_rank = pair, rank
            if best_pair is None:
                break
            # Merge every occurrence of the best pair, left to right and non-overlapping ("aaa" -> "aa", "a").
            first, second = best_pair
            merged: list[str] = []
            index = 0
            num_symbols = len(symbols)
            while index < num_symbols:
                if index + 1 < num_symbols and symbols[index] == first and symbols[index + 1] == second:
                    merged.append(first + second)
                    index += 2
                else:
                    merged.append(symbols[index])
                    index += 1
            symbols = merged
        ids: list[int] = []
        for symbol in symbols:
            token_id = vocab.get(symbol, self._unk_token_id)
            if token_id is not None:
                ids.append(token_id)
        return tuple(ids)


def _compile_added_matcher(added_tokens: Sequence[AddedToken]) -> regex.Pattern[str] | None:
    """One alternation in the given order; group i (1-based) matches the i-th token."""
    if not added_tokens:
        return None
    alternatives = []
    for token in added_tokens:
        left = r"\s*" if token.lstrip else ""
        right = r"\s*" if token.rstrip else ""
        alternatives.append(f"({left}{regex.escape(token.content)}{right})")
    return regex.compile("|".join(alternatives))
