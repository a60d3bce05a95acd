"""A request's structured-output spec, from OpenAI's and vLLM's ways of asking for one. Torch-free.

    response_format {"type": "json_object"}                        -> json_object   (chat and completions)
    response_format {"type": "json_schema", "json_schema": {"schema": {...}}} -> json_schema
    guided_json (schema, object or JSON text), guided_regex, guided_choice, guided_grammar   (vLLM's fields)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}        (vLLM's newer object)

At most one may be given (a 400 otherwise). The router checks shapes only: whether a schema, regex or grammar
compiles is decided by the worker's xgrammar (which imports torch), and a failure comes back as a 400 naming the
problem. A tool choice that constrains the output (router/tools.py) is one more way in.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from engine.request.grammar_spec import GrammarSpec
from router.errors import bad_request
from router.protocol import check_text

if TYPE_CHECKING:
    from router.protocol import ChatCompletionRequest, CompletionRequest

_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                            "json_object": "json_object"}


def structured_outputs_of(request: CompletionRequest | ChatCompletionRequest) -> GrammarSpec | None:
    """The request's GrammarSpec, or None for free text; a 400 naming the field for a bad or doubled one."""
    found: list[tuple[str, GrammarSpec]] = []
    if request.response_format is not None:
        spec = _response_format(request.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if request.guided_json is not None:
        found.append(("guided_json", _schema(request.guided_json, "guided_json")))
    if request.guided_regex is not None:
        found.append(("guided_regex", GrammarSpec(kind="regex", source=request.guided_regex)))
    if request.guided_choice is not None:
        found.append(("guided_choice", GrammarSpec.choice(request.guided_choice)))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", GrammarSpec(kind="grammar", source=request.guided_grammar)))
    if request.structured_outputs is not None:
        found.extend(("structured_outputs", spec) for spec in _structured_outputs(request.structured_outputs))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(name for name, _ in found))
        raise bad_request(f"give one structured output constraint per request, got {names}", found[1][0])
    param, spec = found[0]
    try:
        spec.validate()
    except ValueError as error:
        raise bad_request(str(error).replace("structured_outputs", param, 1), param) from None
    return spec


def _response_format(response_format: dict[str, object]) -> GrammarSpec | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(kind="json_object")
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict):
            raise bad_request("response_format json_schema needs a 'json_schema' object", "response_format")
        schema = json_schema.get("schema", json_schema.get("json_schema"))
        if schema is None:
            raise bad_request("response_format json_schema needs 'json_schema.schema', the JSON schema",
                              "response_format")
        return _schema(schema, "response_format")
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      "response_format")


def _schema(schema: object, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        check_text(schema, param=param)
        try:
            json.loads(schema)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param}: the schema is not valid JSON: {error}", param) from None
        return GrammarSpec.json_schema(schema)
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param}: the schema must be a JSON object, got {type(schema).__name__}", param)
    return GrammarSpec.json_schema(schema)


def _structured_outputs(params: dict[str, object]) -> list[GrammarSpec]:
    specs: list[GrammarSpec] = []
    for key, kind in _STRUCTURED_OUTPUTS_KEYS.items():
        value = params.get(key)
        if value is None or value is False:
            continue
        if kind == "json_schema":
            specs.append(_schema(value, "structured_outputs"))
        elif kind == "json_object":
            specs.append(GrammarSpec(kind="json_object"))
        elif kind == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise bad_request("structured_outputs.choice must be a list of strings", "structured_outputs")
            for index, choice in enumerate(value):
                check_text(choice, param="structured_outputs", where=f"structured_outputs.choice[{index}]")
            specs.append(GrammarSpec.choice(value))
        else:
            if not isinstance(value, str):
                raise bad_request(f"structured_outputs.{key} must be a string", "structured_outputs")
            check_text(value, param="structured_outputs", where=f"structured_outputs.{key}")
            specs.append(GrammarSpec(kind=kind, source=value))  # type: ignore[arg-type]
    unknown = [key for key in params if key not in _STRUCTURED_OUTPUTS_KEYS and params[key]]  # falsy: vLLM defaults
    if unknown:
        raise bad_request(f"structured_outputs: unsupported constraint {unknown[0]!r} (supported: "
                          f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)})", "structured_outputs")
    return specs
