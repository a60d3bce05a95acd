"""Rendering a model's Jinja2 chat template, the way transformers' `apply_chat_template` does.

Templates come from model files, so they run sandboxed (`ImmutableSandboxedEnvironment`: no attribute access to
internals, no mutation of passed-in lists/dicts). The environment mirrors HF's so a template renders the same
text: `trim_blocks` and `lstrip_blocks` on, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII
as is, and the globals `raise_exception` and `strftime_now`.

Variables a template sees: `messages`, `add_generation_prompt`, `bos_token`, `eos_token` (when the model has
them), and `tools`/`documents` set to None, as HF passes them, so `{% if tools is not none %}` stays false; and a
request's own (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`), under any other name (`RESERVED_VARIABLES`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


# The variables `render` sets itself: a request's `chat_template_kwargs` may not name them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"})


class ChatTemplate:
    """A compiled chat template. Compile once per model; `render` is thread-safe."""

    def __init__(self, source: str) -> None:
        """Raises ValueError when the template does not parse."""
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"chat template does not parse: {error.message} (line {error.lineno})") from error
        self.source = source

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; `extra`: more variables, none of `RESERVED_VARIABLES`. ValueError for bad messages, a
        reserved name in `extra`, or when the template itself raises."""
        validate_messages(messages)
        check_extra_variables(extra)
        variables: dict[str, Any] = {
            **(extra or {}),
            # Copies: the sandbox forbids mutating them, and the caller's objects stay untouched either way.
            "messages": [dict(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        if bos_token is not None:
            variables["bos_token"] = bos_token
        if eos_token is not None:
            variables["eos_token"] = eos_token
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template failed: {error}") from error


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """ValueError for both at once (HF's and vLLM's rule): a prompt cannot end inside the last message and open a
    new one."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt to false")


def check_extra_variables(extra: Mapping[str, Any] | None) -> None:
    """ValueError when `extra` (a request's `chat_template_kwargs`) names a variable `render` sets itself."""
    reserved = sorted(RESERVED_VARIABLES.intersection(extra or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do")


def validate_messages(messages: object) -> None:
    """ValueError naming the first problem unless `messages` is a list of {"role": str, "content": str, ...}
    dicts whose values are all strings."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{index}] has no {key!r}")
        for key, value in message.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"messages[{index}][{key!r}] must be a string, got {type(value).__name__}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's builtin tojson escapes HTML characters and sorts keys; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
