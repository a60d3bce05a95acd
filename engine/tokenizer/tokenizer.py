"""Tokenizer: text <-> token ids and chat prompts for one model, from a GGUF file or an HF directory.

Torch-free on purpose: the router tokenizes prompts (prefix-aware routing needs the token ids) and never
imports torch.

    tokenizer = Tokenizer.from_gguf("/models/smollm2.gguf")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)  # the template wrote any BOS already
    text = tokenizer.decode(ids)  # special tokens dropped by default

Streaming output goes through `detokenizer.IncrementalDetokenizer`, which produces exactly `decode(ids)`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from engine.tokenizer.bpe import ByteLevelBPE
from engine.tokenizer.chat_template import ChatTemplate, check_continuation
from engine.tokenizer.pre_tokenizer import PreTokenizer
from engine.tokenizer.spec import TokenizerSpec

if TYPE_CHECKING:
    from gguf import GGUFReader


# Follows the last message's content while `continue_final_message` renders (HF's method); never in a real message.
_CONTINUE_MARKER = "<|splitserve-continue-final-message|> "


class Tokenizer:
    """Immutable after construction; every method is safe to call from several threads."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._bpe = ByteLevelBPE(
            vocab=spec.vocab,
            merges=spec.merges,
            pre_tokenizer=PreTokenizer(spec.pre_tokenizer_stages),
            added_tokens=spec.added_tokens,
            normalization=spec.normalization,
            ignore_merges=spec.ignore_merges,
            unk_token_id=spec.unk_token_id,
            id_to_token=spec.id_to_token,
        )
        self._special_token_ids = frozenset(token.id for token in spec.added_tokens if token.special)
        self._chat_template = ChatTemplate(spec.chat_template) if spec.chat_template is not None else None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFReader) -> Tokenizer:
        """From a GGUF's `tokenizer.*` metadata; pass an open `GGUFReader` to skip parsing the file again.

        ValueError when the vocabulary is not byte-level BPE (`tokenizer.ggml.model` other than "gpt2").
        """
        from engine.tokenizer.gguf_spec import spec_from_gguf

        return cls(spec_from_gguf(path))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a Hugging Face directory holding tokenizer.json (+ tokenizer_config.json, ...)."""
        from engine.tokenizer.hf_spec import spec_from_hf_dir

        return cls(spec_from_hf_dir(path))

    # -- ids ----------------------------------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self.spec.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.spec.eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the declared EOS first, then generation_config.json's others."""
        head = (self.spec.eos_token_id,) if self.spec.eos_token_id is not None else ()
        return head + self.spec.extra_eos_token_ids

    @property
    def vocab_size(self) -> int:
        """One past the largest token id, added tokens included (the model's embedding may be larger)."""
        return self._bpe.vocab_size

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids `decode(skip_special_tokens=True)` drops: GGUF CONTROL tokens, HF added tokens marked special."""
        return self._special_token_ids

    def token_to_id(self, token: str) -> int | None:
        return self._bpe.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._bpe.id_to_token(token_id)

    # -- text ---------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text (e.g. "<|im_start|>") become their ids.

        `add_special_tokens` adds what the model declares around a sequence (BOS when GGUF
        `tokenizer.ggml.add_bos_token` or HF's post-processor / `add_bos_token` say so), nothing otherwise.
        """
        ids = self._bpe.encode(text)
        if add_special_tokens:
            return [*self.spec.prefix_token_ids, *ids, *self.spec.suffix_token_ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text for `ids`; invalid UTF-8 (a character cut at the end) becomes U+FFFD, as in HF.

        Ids outside the vocabulary decode to nothing, as in HF.
        """
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        """The raw bytes behind `ids`, before UTF-8 decoding (what the streaming detokenizer builds on)."""
        special = self._special_token_ids if skip_special_tokens else frozenset()
        token_bytes = self._bpe.token_bytes
        return b"".join(token_bytes(token_id) for token_id in ids if token_id not in special)

    # -- chat ---------------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template is not None else None

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with `source` as its chat template instead of the model's (vLLM's --chat-template); the
        vocabulary is shared, not rebuilt. ValueError when the template does not parse."""
        template = ChatTemplate(source)
        clone = copy.copy(self)
        clone.spec = dataclasses.replace(self.spec, chat_template=source)
        clone._chat_template = template
        return clone

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
        extra: Mapping[str, object] | None = None, *, continue_final_message: bool = False,
    ) -> str:
        """The prompt text for `messages` (a list of {"role", "content"} string dicts), not yet tokenized.

        Encode the result with `add_special_tokens=False`: the template already writes any BOS the model wants
        (HF's `apply_chat_template(tokenize=True)` does the same). ValueError when the model has no chat template
        or the messages are malformed. `extra`: more variables for the template (vLLM's `chat_template_kwargs`).
        `continue_final_message` (HF's and vLLM's): the text ends with the last message's content, left open for the
        model to go on with it (whatever the template writes after that content, its end of turn, is cut).
        """
        if self._chat_template is None:
            raise ValueError(f"{self.spec.source or 'this model'} has no chat template; send a plain prompt instead")
        check_continuation(add_generation_prompt, continue_final_message)
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a last message with text content")
            # A marker after the last message's content shows where it ends once rendered; what follows is cut.
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_MARKER}]
        text = self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.spec.bos_token_id),
            eos_token=self._token_text(self.spec.eos_token_id),
            extra=extra,
        )
        if not continue_final_message:
            return text
        end = text.rfind(_CONTINUE_MARKER.strip())
        if end < 0:
            raise ValueError("continue_final_message: the chat template does not write the last message's content")
        # As HF's: a template that keeps the content's spacing keeps it here too; one that strips it, strips it.
        return text[:end] if text.startswith(_CONTINUE_MARKER, end) else text[:end].rstrip()

    def _token_text(self, token_id: int | None) -> str | None:
        return self._bpe.id_to_token(token_id) if token_id is not None else None
