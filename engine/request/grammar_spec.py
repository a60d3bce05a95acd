"""What a request's structured output must follow. Control plane: no torch, no xgrammar.

One `GrammarSpec` per request, built by the router from OpenAI's `response_format`, vLLM's guided fields
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), vLLM's `structured_outputs` object or a tool
choice, and carried in `SamplingParams.structured_outputs` (protobuf `StructuredOutputs` across processes). Its
`source` is text, so that equal requests give equal specs: the compiler cache is keyed by (kind, source).

    kind          source
    json_schema   a JSON schema, as JSON text
    json_object   "" (any JSON object)
    regex         a regular expression (xgrammar's dialect, ECMAScript-like)
    choice        a JSON list of strings: the output is exactly one of them
    grammar       an EBNF grammar (xgrammar's / GBNF dialect, with a `root` rule)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)

# A spec's text travels in every Generate and Prefill message (4 MiB gRPC limit) and is compiled by the worker.
MAX_SOURCE_CHARS = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class GrammarSpec:
    kind: GrammarKind
    source: str = ""

    def validate(self) -> None:
        """ValueError naming the problem with the spec's shape (whether it compiles is the compiler's call)."""
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"structured_outputs kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ValueError(f"structured_outputs {self.kind} must be at most {MAX_SOURCE_CHARS} characters, "
                             f"got {len(self.source)}")
        if self.kind == "json_object":
            return
        if not self.source:
            raise ValueError(f"structured_outputs {self.kind} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs json_schema is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs json_schema must be a JSON object")
        if self.kind == "choice":
            try:
                choices = json.loads(self.source)
            except json.JSONDecodeError:
                choices = None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")

    @classmethod
    def json_schema(cls, schema: object) -> GrammarSpec:
        """From a schema given as JSON text or as a parsed object; keys keep their order (it is the output's)."""
        return cls(kind="json_schema", source=schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls(kind="choice", source=json.dumps(list(choices)))
