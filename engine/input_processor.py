"""From what a caller asks for to a `Request` ready to queue: the sampling params validated, a grammar compiled, the
prompt tokenized and checked against the model (vocabulary, context length), the choices of n > 1 made.

It touches no engine state, so a caller can check a whole batch before queueing any of it, and can do so on any
thread (the worker does it off its event loop: compiling a grammar can take a second). No torch.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from engine.core.fork import choice_params, choice_request_id
from engine.core.request import Request
from engine.request.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, check_engine_rules
from engine.request.bad_words import bad_words_token_ids, maybe_bannable
from engine.request.lora import LoRAError
from engine.tokenizer.tokenizer import Tokenizer
from kv_transfer.block_hash import BlockHashNamespace, adapter_root

if TYPE_CHECKING:
    from engine.lora.adapter import LoRAAdapter
    from engine.lora.registry import LoRARegistry
    from engine.structured.compiler import GrammarCompilerCache


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        hash_namespace: BlockHashNamespace | None,
        use_grammars: Callable[[GrammarCompilerCache], None],
        scheduling_policy: str = "fcfs",
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        loras: LoRARegistry | None = None,
    ) -> None:
        """`hash_namespace`: what the requests hash their blocks in (None: no prefix caching). `use_grammars` is
        called once, with the grammar compiler cache made for the first request that has a grammar (the runner
        builds its matchers from it). `scheduling_policy` "fcfs" takes only requests of priority 0; `max_logprobs`
        caps (prompt) logprobs, -1 at the vocabulary's size. `loras`: the adapters requests may name (None: LoRA
        off)."""
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.hash_namespace = hash_namespace
        self.loras = loras
        self._use_grammars = use_grammars
        # Structured outputs: xgrammar loads with the first request that has a grammar (see grammar_compilers).
        self._grammar_compilers: GrammarCompilerCache | None = None
        self._grammar_lock = threading.Lock()

    def make_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *, remote_decode: bool = False,
        lora_name: str | None = None,
    ) -> Request:
        """A validated, tokenized request, and the choices it will fork (n > 1) as its `pending_forks`, running
        under the LoRA adapter `lora_name` if given. Raises ValueError naming the problem.

        A request with `structured_outputs` has its grammar compiled here (a schema that does not compile is a
        ValueError). `remote_decode` (a prefill worker's request): only choice 0, whose KV is handed off after its
        first token; the decode worker forks the others."""
        params.validate()
        lora = self._lora(lora_name)
        check_engine_rules(params, scheduling_policy=self.scheduling_policy, max_logprobs=self.max_logprobs)
        if params.structured_outputs is not None:
            self.grammar_compilers().compile(params.structured_outputs)
        prompt_ids = self._prompt_ids(prompt)
        self._check_in_vocab(params.logit_bias, "logit_bias token ids")
        self._check_allowed_tokens(params)
        bad_words = self._bad_words(params)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        room = self.max_model_len - len(prompt_ids)
        eos = tuple(self.tokenizer.eos_token_ids)
        # n > 1 (best_of): the other choices wait on choice 0 until its prompt is computed (engine/core/fork.py).
        num_sequences = 1 if remote_decode else params.num_sequences
        requests = [
            Request(
                choice_request_id(request_id, index),
                prompt_ids,
                choice_params(params, index) if params.num_sequences > 1 else params,
                eos_token_ids=eos,
                max_tokens=min(params.max_tokens or room, room),
                hash_namespace=self.hash_namespace,
                remote_decode=remote_decode,
                index=index,
                bad_words_token_ids=bad_words,
                lora=lora,
                hash_root=None if lora is None or self.hash_namespace is None else adapter_root(
                    self.hash_namespace, lora.digest),
            )
            for index in range(num_sequences)
        ]
        requests[0].pending_forks = requests[1:]
        return requests[0]

    def _lora(self, name: str | None) -> LoRAAdapter | None:
        if name is None:
            return None
        if self.loras is None:
            raise LoRAError(f"LoRA adapter {name!r} asked for, but this engine serves none (--enable-lora)")
        return self.loras.get(name)  # a LoRAError (ValueError) naming what is loaded

    def _check_allowed_tokens(self, params: SamplingParams) -> None:
        """ValueError for allowed_token_ids out of the vocabulary, or all masked while min_tokens holds off EOS and
        the stop token ids (nothing would be left to sample)."""
        allowed = params.allowed_token_ids
        self._check_in_vocab(allowed, "allowed_token_ids")
        if allowed and params.min_tokens and set(allowed) <= {*self.tokenizer.eos_token_ids, *params.stop_token_ids}:
            raise ValueError("allowed_token_ids holds only EOS and stop token ids, which min_tokens masks: nothing "
                             "would be left to sample")

    def _bad_words(self, params: SamplingParams) -> list[tuple[int, ...]]:
        """`params.bad_words` as token sequences; ValueError when the tokens they may ban, with those min_tokens
        masks, could leave nothing to sample (all of allowed_token_ids, or the whole vocabulary)."""
        if not params.bad_words:
            return []
        sequences = bad_words_token_ids(params.bad_words,
                                        lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        masked = maybe_bannable(sequences)
        if params.min_tokens:
            masked |= {*self.tokenizer.eos_token_ids, *params.stop_token_ids}
        candidates = set(params.allowed_token_ids) if params.allowed_token_ids else range(self.vocab_size)
        if all(token_id in masked for token_id in candidates):
            raise ValueError("bad_words may ban every token left to sample (allowed_token_ids, less what min_tokens "
                             "masks): nothing would be left")
        return sequences

    def _check_in_vocab(self, token_ids: Iterable[int], what: str) -> None:
        """ValueError naming `what` for ids at or past the vocabulary's size (the params checked the sign)."""
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"{what} out of range [0, {self.vocab_size}): {bad[:5]}")

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, each within the vocabulary; a ValueError for an empty or malformed prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            try:  # an int-like id (numpy's too) is taken; a float or str would fail later, inside a shared step
                prompt_ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError(f"a prompt is text or a sequence of integer token ids, got {prompt!r:.100}") from None
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return prompt_ids

    def grammar_compilers(self) -> GrammarCompilerCache:
        """The grammar compiler cache, made (and handed to `use_grammars`) on first use, from any thread."""
        with self._grammar_lock:
            if self._grammar_compilers is None:
                from engine.structured.compiler import GrammarCompilerCache

                compilers = GrammarCompilerCache(self.tokenizer, vocab_size=self.vocab_size)
                self._use_grammars(compilers)
                self._grammar_compilers = compilers
            return self._grammar_compilers
