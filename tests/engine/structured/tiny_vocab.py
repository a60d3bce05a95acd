"""A tiny byte-level vocabulary for grammar tests without a real tokenizer: the 256 bytes (ids 0-255), a few
merged tokens, and an EOS."""

from __future__ import annotations

from engine.tokenizer.bpe import BYTE_TO_UNICODE

MERGED = ['{"', '":', ' "', '",', "true", "false", "}", "ab", "abc"]
EOS_ID = 256 + len(MERGED)
VOCAB_SIZE = EOS_ID + 1 + 6  # the model's logits are wider than the tokenizer (6 ids with no token)


class TinyTokenizer:
    vocab_size = EOS_ID + 1
    eos_token_ids = (EOS_ID,)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id < 256:
            return BYTE_TO_UNICODE[token_id]
        if token_id < EOS_ID:
            return "".join(BYTE_TO_UNICODE[b] for b in MERGED[token_id - 256].encode())
        return "<|end|>" if token_id == EOS_ID else None


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def token_id(token: str) -> int:
    return 256 + MERGED.index(token)
