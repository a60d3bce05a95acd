"""vLLM's `bad_words`: words the output must not contain. No torch.

Each word becomes one or two token sequences (`bad_words_token_ids`): its text as the tokenizer reads it at the start
of a text, and, when that is a different first token in as many tokens, with a space before it (most words inside a
text are those). A sequence of one token is never sampled. A longer one is never completed: once the output ends
with all of it but its last token, that token is masked for the next step (`banned_next_tokens`), as vLLM matches
them, against the output only (the prompt does not count). The mask is the sampler's min_tokens mask
(engine/sampling/sampling_batch.py), so it holds for greedy and random rows, a draft's verification included.

A sequence of more than one token needs the output on the host to decide the next step's mask: async scheduling
does not schedule such a request ahead (engine/core/overlap.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[tuple[int, ...]]:
    """The token sequences `words` ban: for each word, its text without leading whitespace, and the same after
    one space when that tokenizes into as many tokens starting with another one. `encode` adds no special token.
    ValueError for a word that tokenizes to nothing."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        text = word.lstrip()
        bare = tuple(encode(text))
        if not bare:
            raise ValueError(f"bad_words entry {word!r:.60} has no tokens")
        sequences.append(bare)
        spaced = tuple(encode(" " + text))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences


def banned_next_tokens(sequences: Iterable[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens the next step must not sample: each one-token sequence, and the last token of each longer one
    whose other tokens end the output."""
    banned = []
    num_output = len(output_token_ids)
    for sequence in sequences:
        prefix_len = len(sequence) - 1
        if prefix_len == 0:
            banned.append(sequence[0])
        elif prefix_len <= num_output and all(
            output_token_ids[num_output - prefix_len + i] == token for i, token in enumerate(sequence[:-1])
        ):
            banned.append(sequence[-1])
    return banned


def needs_output_context(sequences: Iterable[Sequence[int]]) -> bool:
    """Whether some sequence is longer than one token (its ban depends on the output so far)."""
    return any(len(sequence) > 1 for sequence in sequences)


def maybe_bannable(sequences: Iterable[Sequence[int]]) -> set[int]:
    """Every token the sequences may ban at some step (the last token of each)."""
    return {sequence[-1] for sequence in sequences}
