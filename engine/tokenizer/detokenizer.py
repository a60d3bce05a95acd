"""Streaming detokenization with stop strings.

A byte-level token can end in the middle of a UTF-8 character (an emoji is often 2-4 tokens), and a stop string
can arrive split over several tokens. So each request's output goes through one `IncrementalDetokenizer`:

    token ids ──bytes──▶ incremental UTF-8 decoder ──text──▶ StopChecker ──▶ delta safe to stream
                         (holds an unfinished character)      (holds a tail that may start a stop string)

Contract: without stop strings, the deltas of `add_token` followed by `finish` concatenate to exactly
`tokenizer.decode(ids, skip_special_tokens)`. With stop strings, they concatenate to that text cut before the
first stop string (after it, with include_stop_str_in_output), and no delta ever contains text that later turns
out to be part of a stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class StopMatch:
    stop_str: str  # the stop string found
    text: str  # the whole output text, cut at the stop string (kept or not, per include_stop_str_in_output)


class StopChecker:
    """Finds stop strings in a growing text; pure, holds no per-request state."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not stop_str for stop_str in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop: tuple[str, ...] = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output

    def find(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The stop string that starts earliest among those ending in the last `num_new_chars` characters.

        Only matches that end in the new characters are looked for: an earlier one would have been found on an
        earlier call.
        """
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            start = text.find(stop_str, max(0, len(text) - num_new_chars - len(stop_str) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop_str)
        if best is None:
            return None
        start, stop_str = best
        end = start + len(stop_str) if self.include_stop_str_in_output else start
        return StopMatch(stop_str=stop_str, text=text[:end])

    def num_held_chars(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string.

        Those characters must not be streamed yet: the next token may complete the stop string, and then they
        are not part of the output.
        """
        held = 0
        for stop_str in self.stop:
            for length in range(min(len(stop_str) - 1, len(text)), held, -1):
                if text.endswith(stop_str[:length]):
                    held = length
                    break
        return held


class IncrementalDetokenizer:
    """Turns one request's output token ids, one at a time, into text deltas safe to stream.

    Lifecycle: `add_token` for each generated id until `stopped` or generation ends, then `finish` once.
    After a stop string is found, `add_token` ignores further ids and returns "".
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop_checker = StopChecker(stop, include_stop_str_in_output) if stop else None
        self._text = ""
        self._num_sent_chars = 0
        self._stop_str: str | None = None

    @property
    def text(self) -> str:
        """All text decoded so far (cut at the stop string once stopped), streamed or still held back."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stop_str is not None

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_str

    def add_token(self, token_id: int) -> str:
        """Feed one token id; returns the new text that is safe to stream (often "", e.g. mid-character)."""
        if self.stopped:
            return ""
        data = self._tokenizer.decode_bytes((token_id,), self._skip_special_tokens)
        return self._advance(self._decoder.decode(data))

    def finish(self) -> str:
        """End of generation: returns everything still held back (an unfinished character becomes U+FFFD)."""
        if self.stopped:
            return ""  # everything up to the stop string went out with the token that completed it
        delta = self._advance(self._decoder.decode(b"", final=True))
        delta += self._text[self._num_sent_chars :]  # a partial stop string that never completed
        self._num_sent_chars = len(self._text)
        return delta

    def _advance(self, new_text: str) -> str:
        self._text += new_text
        safe_end = len(self._text)
        if self._stop_checker is not None:
            match = self._stop_checker.find(self._text, len(new_text)) if new_text else None
            if match is not None:
                self._text, self._stop_str = match.text, match.stop_str
                safe_end = len(self._text)
            else:
                safe_end -= self._stop_checker.num_held_chars(self._text)
        if safe_end <= self._num_sent_chars:
            return ""
        delta = self._text[self._num_sent_chars : safe_end]
        self._num_sent_chars = safe_end
        return delta
