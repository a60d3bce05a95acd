"""Compiling a `GrammarSpec` for one tokenizer with xgrammar, once per spec.

Compiling a JSON schema against a 49k-token vocabulary takes ~0.3 s on one core, so it never runs on an event
loop: the workers call `compile` (through `LLMEngine.make_request`) on a worker thread before the request is
queued, and the engine step only finds it in the cache. The cache is an LRU of `max_entries` compiled grammars
keyed by the spec (kind and text); a spec evicted before its request's first step is compiled again there.

A spec that does not compile is a ValueError naming the problem (xgrammar's own message, its C++ source location
dropped), which the workers turn into INVALID_ARGUMENT and the router into a 400.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.request.grammar_spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

    from engine.tokenizer.tokenizer import Tokenizer

# "[23:05:27] /project/cpp/json_schema_converter.cc:4944: " and "Check failed: (error.empty()) is false: "
_XGRAMMAR_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \([^)]*\) is false: ")


class GrammarCompilerCache:
    """Thread-safe: `compile` may run on several threads while the engine thread reads the cache."""

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, max_entries: int = 256, max_threads: int = 1
                 ) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's; the ids past it are never allowed)."""
        import xgrammar as xgr

        # The GGUF / HF byte-level BPE vocabulary, spelled as in tokenizer.json ("Ġhello"), which is what
        # xgrammar's BYTE_LEVEL decoding expects. Ids without a token get "" (never allowed).
        vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        self.tokenizer_info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                                stop_token_ids=list(tokenizer.eos_token_ids))
        # xgrammar's own cache is off: ours bounds the entries and is the one place a spec is looked up.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._cache: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations done (misses), for tests and stats

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec`, from the cache or compiled now. ValueError when it does not compile."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        compiled = self._compile(spec)  # outside the lock: a long compile blocks no other request
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        spec.validate()
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                # Compact whitespace (json.dumps' separators): free whitespace lets a small model pad forever.
                return compiler.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "json_object":  # OpenAI's: an object (xgrammar's builtin JSON takes any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec.source)))
            return compiler.compile_grammar(spec.source)
        except RuntimeError as error:  # xgrammar raises RuntimeError for every bad schema, regex or grammar
            raise ValueError(f"invalid {spec.kind}: {clean_error(str(error))}") from None


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose root is exactly one of `choices` (JSON string escapes are xgrammar's string literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def clean_error(message: str) -> str:
    """xgrammar's message without its timestamp and C++ source location; one line, at most 500 characters."""
    text = " ".join(_XGRAMMAR_NOISE.sub("", message).split())
    return text[:500]
