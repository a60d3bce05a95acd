"""Tool calls: `tools` and `tool_choice` on chat completions, as OpenAI and vLLM take them. Torch-free.

    tool_choice   the prompt                          the output                       the answer
    none          the tools are not shown             free text                        content
    auto          the tools, in the chat template     free text, Hermes-style calls:   content and/or tool_calls
                  (or the generic prompt below)       <tool_call>{"name", "arguments"}</tool_call>
    required      the tools, likewise                 a JSON array of {"name", "parameters"}, constrained to
                                                      the tools' names and parameter schemas (xgrammar)
    {"type": "function", "function": {"name": f}}     f's arguments, constrained to f's parameter schema

`required` and a named function cannot come out wrong, whatever the model: the grammar admits only calls that
validate. `auto` parses what the model wrote; output that does not parse as calls comes back as content (never
an error). The answer's `tool_calls` are OpenAI's ({"id", "type": "function", "function": {"name",
"arguments": JSON text}}), finish_reason "tool_calls"; streamed, a call comes as one delta naming it (id, name,
arguments "") and then its arguments, `index` counting the calls, as OpenAI streams them.

The generic tool prompt (used when the model's chat template does not take `tools`, as SmolLM2's does not) is a
system message in the style of Hermes / Qwen templates and vLLM's tool examples: the tools as JSON in <tools>, and
the <tool_call> format. Earlier turns are rendered as text: an assistant's tool_calls as <tool_call> blocks, a
"tool" message as <tool_response>.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.request.grammar_spec import GrammarSpec
from router.errors import bad_request
from router.protocol import ChatCompletionRequest, check_text

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

GENERIC_TOOL_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Here are the available functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding the function's name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


@dataclass(frozen=True, kw_only=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            body["description"] = self.description
        return {"type": "function", "function": body}


@dataclass(frozen=True, kw_only=True)
class ToolPlan:
    """What a request's tools and tool_choice mean for its prompt, its grammar and its answer."""

    mode: Literal["auto", "required", "named"]
    functions: tuple[Function, ...]
    named: Function | None = None
    parallel_tool_calls: bool = True

    def structured_outputs(self) -> GrammarSpec | None:
        """The grammar the output must follow: `required` and named constrain it, `auto` does not."""
        if self.mode == "named":
            assert self.named is not None
            return GrammarSpec.json_schema(self.named.parameters)
        if self.mode == "required":
            calls = {"anyOf": [
                {"type": "object",
                 "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": f.parameters},
                 "required": ["name", "parameters"]}
                for f in self.functions
            ]}
            schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
            if not self.parallel_tool_calls:
                schema["maxItems"] = 1
            return GrammarSpec.json_schema(schema)
        return None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)


def plan_tools(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ToolPlan; None when it has no tools or tool_choice is "none". A 400 naming what is wrong."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = tuple(_function(tool, index) for index, tool in enumerate(request.tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    if choice is None or choice == "auto":
        return ToolPlan(mode="auto", functions=functions, parallel_tool_calls=request.parallel_tool_calls)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(mode="required", functions=functions, parallel_tool_calls=request.parallel_tool_calls)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        named = next((f for f in functions if f.name == name), None)
        if named is None:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(mode="named", functions=functions, named=named)
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                      "tool_choice")


def _function(tool: dict[str, object], index: int) -> Function:
    where = f"tools[{index}]"
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string", "tools")
    check_text(name, param="tools", where=f"{where}.function.name", allow_nul=False)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    if description is not None:
        check_text(description, param="tools", where=f"{where}.function.description", allow_nul=False)
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    return Function(name=name, description=description, parameters=parameters)


# -- the prompt ------------------------------------------------------------------------------------------------


def tool_messages(request: ChatCompletionRequest, messages: list[dict[str, str]], plan: ToolPlan | None
                  ) -> list[dict[str, str]]:
    """`messages` (role and text content, one per request message) with the tool turns written as text and,
    when the plan shows tools, the generic tool prompt as (or in front of) the system message."""
    out: list[dict[str, str]] = []
    for message, rendered in zip(request.messages, messages, strict=True):
        content = rendered["content"]
        if message.role == "assistant" and message.tool_calls:
            blocks = [_call_text(call) for call in message.tool_calls]
            content = "\n".join([content, *blocks] if content else blocks)
        if message.role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": rendered["role"], "content": content})
    if plan is None:
        return out
    prompt = GENERIC_TOOL_PROMPT.format(tools="\n".join(json.dumps(f.openai()) for f in plan.functions))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_text(call: dict[str, object]) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise bad_request("messages: an assistant tool_call needs a 'function'", "messages")
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments
    return f"{TOOL_CALL_START}\n{json.dumps({'name': function.get('name'), 'arguments': parsed})}\n{TOOL_CALL_END}"


# -- the answer ------------------------------------------------------------------------------------------------


@dataclass
class ToolCallParser:
    """Turns one request's output text into content and tool calls, whole (`parse`) or as it streams
    (`feed`, then `finish`), each giving OpenAI delta pieces: {"content": str} or {"tool_calls": [...]}."""

    plan: ToolPlan
    num_calls: int = 0
    _buffer: str = ""
    _inside_call: bool = False
    _named_id: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) for the whole output."""
        deltas = self.feed(text) + self.finish()
        content = "".join(d["content"] for d in deltas if "content" in d)
        return (content or None), self.calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            return self._feed_named(text)
        self._buffer += text
        if self.plan.mode == "required":
            return []  # one JSON array: parsed whole at the end
        return self._drain(final=False)

    def finish(self) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            return [] if self._named_id is not None else self._feed_named("", force=True)
        if self.plan.mode == "required":
            return self._required_calls()
        return self._drain(final=True)

    # -- named: the output is the arguments ----------------------------------------------------------------------
    def _feed_named(self, text: str, *, force: bool = False) -> list[dict[str, Any]]:
        assert self.plan.named is not None
        deltas: list[dict[str, Any]] = []
        if self._named_id is None and (text or force):
            self._named_id = _call_id()
            deltas.append(self._start_call(self._named_id, self.plan.named.name))
        if text:
            self.calls[-1]["function"]["arguments"] += text
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    # -- required: a JSON array of {"name", "parameters"} --------------------------------------------------------
    def _required_calls(self) -> list[dict[str, Any]]:
        text, self._buffer = self._buffer, ""
        try:
            items = json.loads(text)
            calls = [(item["name"], item["parameters"]) for item in items]
            if not calls or not all(isinstance(name, str) for name, _ in calls):
                raise ValueError("no calls")
        except (ValueError, TypeError, KeyError):
            return [{"content": text}] if text else []  # e.g. cut by max_tokens
        deltas: list[dict[str, Any]] = []
        for name, arguments in calls:
            deltas.extend(self._whole_call(name, arguments))
        return deltas

    # -- auto: text with <tool_call> blocks ------------------------------------------------------------------------
    def _drain(self, *, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self._buffer:
            if not self._inside_call:
                start = self._buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, TOOL_CALL_START)
                    cut = len(self._buffer) - keep
                    text, self._buffer = self._buffer[:cut], self._buffer[cut:]
                    if text:
                        deltas.append({"content": text})
                    break
                if start:
                    deltas.append({"content": self._buffer[:start]})
                self._buffer = self._buffer[start + len(TOOL_CALL_START):]
                self._inside_call = True
            end = self._buffer.find(TOOL_CALL_END)
            if end < 0 and not final:
                break
            body = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(TOOL_CALL_END):]
            self._inside_call = False
            call = _parse_call(body)
            if call is None:
                closing = TOOL_CALL_END if end >= 0 else ""
                deltas.append({"content": f"{TOOL_CALL_START}{body}{closing}"})
            else:
                deltas.extend(self._whole_call(*call))
        return _merge_content(deltas)

    def _whole_call(self, name: str, arguments: object) -> list[dict[str, Any]]:
        index = len(self.calls)
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        start = self._start_call(_call_id(), name)
        self.calls[-1]["function"]["arguments"] = text
        return [start, {"tool_calls": [{"index": index, "function": {"arguments": text}}]}]

    def _start_call(self, call_id: str, name: str) -> dict[str, Any]:
        index = len(self.calls)
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}


def _parse_call(body: str) -> tuple[str, object] | None:
    """(name, arguments) from a <tool_call> block's JSON, or None when it is not a call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return call["name"], arguments


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may be arriving)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _merge_content(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        if "content" in delta and merged and "content" in merged[-1]:
            merged[-1] = {"content": merged[-1]["content"] + delta["content"]}
        else:
            merged.append(delta)
    return merged


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
