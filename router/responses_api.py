"""OpenAI's Responses API, `POST /v1/responses`, stateless: a chat completion underneath, in the Responses shapes.

    ResponsesRequest ──to_chat_request──▶ ChatCompletionRequest ──(the chat path: prompt, params, dispatch)──▶
    chat body / chat stream bodies ──ResponseShape.body / .events──▶ response object / Responses SSE events

What the request may hold (vLLM's subset, and what vLLM serves without its response store):
- `input`: a text (one user message), or a list of items: messages (`role` user / assistant / system / developer,
  the last read as system; `content` a text or `input_text` / `output_text` parts), `function_call` items (an
  assistant turn's calls) and `function_call_output` items (their results, as tool messages). Other item and
  part types (images, files, reasoning) are a 400 naming `input`.
- `instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, `tools` (function tools:
  `{"type": "function", "name", "parameters"}`, others a 400), `tool_choice`, `parallel_tool_calls`,
  `text.format` (text, json_object, json_schema: structured outputs), `stream`, `metadata` and `user` (echoed),
  `include: ["message.output_text.logprobs"]` with `top_logprobs` (the output text's logprobs, as chat's),
  and the chat fields vLLM users send beside them (`top_k`, `seed`, `stop`, `priority`, ...: `PASSED_FIELDS`).
- Nothing is stored: `previous_response_id` and `background` are a 400 (send the conversation in `input`), `store`
  is read and the response says `false`.

The answer: one `message` item with one `output_text` part (when there is text), then one `function_call` item per
tool call; `status` "incomplete" with `incomplete_details.reason` "max_output_tokens" when the length cap ended it;
`usage` in input/output tokens. Streamed: response.created, response.in_progress, each item's added / delta / done
events, then response.completed (or response.incomplete; response.failed with the error when the request failed),
every event with its `sequence_number`, each as `event: <type>` and `data: <json>`, no [DONE].
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from router.errors import bad_request
from router.protocol import ChatCompletionRequest, check_json_text, check_text

# The chat request's fields a Responses request may carry under the same name (vLLM's extensions, and OpenAI's
# own that both APIs share); the rest of the chat request is built from the Responses fields.
PASSED_FIELDS = frozenset({
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "priority",
    "request_id", "skip_special_tokens", "include_stop_str_in_output", "chat_template_kwargs", "chat_template",
    "truncate_prompt_tokens", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})
# The chat request's parameters an error may name, by the Responses names the client used.
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


LOGPROBS = "message.output_text.logprobs"  # the `include` value asking for output logprobs


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # LOGPROBS asks for the output text's logprobs, each with `top_logprobs` alternatives;
    # the other values name content this server never produces (file search results, reasoning), so they add nothing
    include: list[str] | None = None
    top_logprobs: int | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that computes `request`'s answer; a 400 naming the field for what cannot be
    served."""
    if request.previous_response_id is not None:
        raise bad_request("this server stores no responses: send the whole conversation in `input` instead of "
                          "previous_response_id", "previous_response_id")
    if request.background:
        raise bad_request("background responses need a response store, which this server does not keep",
                          "background")
    messages = _messages(request)
    fields: dict[str, Any] = {name: value for name, value in (request.model_extra or {}).items()
                              if name in PASSED_FIELDS}
    fields.update(model=request.model, messages=messages, stream=request.stream,
                  parallel_tool_calls=request.parallel_tool_calls)
    if request.stream:
        fields["stream_options"] = {"include_usage": True}  # the final event's usage
    for name, value in (("max_completion_tokens", request.max_output_tokens), ("temperature", request.temperature),
                        ("top_p", request.top_p), ("user", request.user)):
        if value is not None:
            fields[name] = value
    if request.wants_logprobs:
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools is not None:
        fields["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(request.tool_choice)
    response_format = _response_format(request.text)
    if response_format is not None:
        fields["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        raise bad_request(f"{'.'.join(map(str, first['loc']))}: {first['msg']}", str(first["loc"][0])) from None


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    if not request.input:
        raise bad_request("input must not be empty", "input")
    for index, item in enumerate(request.input):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, index))
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", index), "type": "function",
                    "function": {"name": _text_field(item, "name", index),
                                 "arguments": _text_field(item, "arguments", index)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls made in one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", index),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise bad_request(f"input[{index}] is a {kind!r} item; this server takes message, function_call and "
                              "function_call_output items", "input")
    return messages


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    role = _ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise bad_request(f"input[{index}].role must be one of {', '.join(_ROLES)}, got {item.get('role')!r:.40}",
                          "input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"input[{index}].content must be a text or a list of text parts", "input")
    texts = []
    for part_index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"input[{index}].content[{part_index}] is {kind!r:.40}: only text parts "
                              f"({', '.join(_TEXT_PARTS[:2])}) are served", "input")
        texts.append({"type": "text", "text": part["text"]})
    return {"role": role, "content": texts}


def _text_field(item: dict[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"input[{index}].{name} must be a string", "input")
    return value


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's (under "function")."""
    if tool.get("type") != "function":
        raise bad_request(f"tools[{index}] is a {tool.get('type')!r:.40} tool; this server serves function tools",
                          "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format; None for plain text."""
    form = (text or {}).get("format")
    if form is not None and not isinstance(form, dict):
        raise bad_request("text.format must be an object", "text")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        schema = {key: form[key] for key in ("name", "schema", "strict", "description") if key in form}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {form.get('type')!r:.40}",
                      "text")


class ResponseShape:
    """The Responses API's answer to one request, from the chat completion's."""

    def __init__(self, request: ResponsesRequest, chat: ChatCompletionRequest) -> None:
        self.request = request
        self.chat = chat
        self.created_at = int(time.time())

    def response_id(self, chat_id: str) -> str:
        return "resp_" + chat_id.split("-", 1)[-1]

    def body(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        """The response object for a non-streaming chat completion body."""
        choice = chat_body["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        if message.get("content") or not message.get("tool_calls"):
            item = self._text_item(status, message.get("content") or "")
            if self.request.wants_logprobs:
                item["content"][0]["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
            output.append(item)
        for call in message.get("tool_calls") or ():
            output.append(_call_item(_item_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        return self._response(self.response_id(chat_body["id"]), status, output, chat_body.get("usage"))

    def _text_item(self, status: str, text: str = "") -> dict[str, Any]:
        """A message item with one output_text part (holding its logprobs, when the request includes them)."""
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.request.wants_logprobs:
            part["logprobs"] = []
        return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant", "content": [part]}

    def _response(self, response_id: str, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        return {
            "id": response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": request.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": request.temperature,
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [],
            "top_p": request.top_p,
            "top_logprobs": request.top_logprobs,
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            "user": request.user,
            "metadata": request.metadata or {},
        }

    async def events(self, bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """The Responses SSE events of a streaming chat completion's bodies (router/streaming.py)."""
        stream = _EventStream()
        response_id = None
        output: list[dict[str, Any]] = []
        text_item: dict[str, Any] | None = None  # the message item being streamed
        calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item
        finish_reason = None
        async for body in bodies:
            if response_id is None:
                response_id = self.response_id(body.get("id", "resp-" + uuid.uuid4().hex))
                yield stream.event("response.created", response=self._response(response_id, "in_progress", [], None))
                yield stream.event("response.in_progress",
                                   response=self._response(response_id, "in_progress", [], None))
            if "error" in body:
                error = body["error"]
                failed = self._response(response_id, "failed", output, None,
                                        error={"code": str(error.get("code") or "server_error"),
                                               "message": error.get("message", "")})
                yield stream.event("response.failed", response=failed)
                return
            for choice in body.get("choices") or ():
                delta = choice.get("delta", {})
                entries = (choice.get("logprobs") or {}).get("content") or [] if self.request.wants_logprobs else []
                if delta.get("content"):
                    if text_item is None:
                        text_item = self._text_item("in_progress")
                        output.append(text_item)
                        for event in self._open_message(stream, text_item, len(output) - 1):
                            yield event
                    text_item["content"][0]["text"] += delta["content"]
                    yield stream.event("response.output_text.delta", item_id=text_item["id"],
                                       output_index=output.index(text_item), content_index=0,
                                       delta=delta["content"], logprobs=entries)
                if entries and text_item is not None:  # with tools, a text's logprobs may come after it
                    text_item["content"][0]["logprobs"].extend(entries)
                for call_delta in delta.get("tool_calls") or ():
                    item = calls.get(call_delta["index"])
                    function = call_delta.get("function", {})
                    if item is None:
                        item = _call_item(_item_id("fc"), call_delta.get("id", ""), function.get("name", ""), "",
                                          "in_progress")
                        calls[call_delta["index"]] = item
                        output.append(item)
                        yield stream.event("response.output_item.added", output_index=len(output) - 1,
                                           item=dict(item))
                    if function.get("arguments"):
                        item["arguments"] += function["arguments"]
                        yield stream.event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=output.index(item), delta=function["arguments"])
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = body.get("usage")
            if usage is not None and not body.get("choices"):  # the last body: the request's usage
                status = "incomplete" if finish_reason == "length" else "completed"
                if text_item is None and not calls:  # no text at all: still one (empty) message, as the body has
                    text_item = self._text_item("in_progress")
                    output.append(text_item)
                    for event in self._open_message(stream, text_item, 0):
                        yield event
                for index, item in enumerate(output):
                    for event in self._close_item(stream, item, index, status):
                        yield event
                final = "response.incomplete" if status == "incomplete" else "response.completed"
                yield stream.event(final, response=self._response(response_id, status, output, usage))

    @staticmethod
    def _open_message(stream: _EventStream, item: dict[str, Any], index: int) -> list[str]:
        added = {**item, "content": []}
        return [stream.event("response.output_item.added", output_index=index, item=added),
                stream.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})]

    @staticmethod
    def _close_item(stream: _EventStream, item: dict[str, Any], index: int, status: str) -> list[str]:
        events = []
        if item["type"] == "message":
            item["status"] = status
            part = item["content"][0]
            events += [stream.event("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=part["text"], logprobs=part.get("logprobs", [])),
                       stream.event("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)]
        else:
            item["status"] = "completed"
            events.append(stream.event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]))
        events.append(stream.event("response.output_item.done", output_index=index, item=item))
        return events


class _EventStream:
    """Numbers the events of one response."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def check_responses_request(request: ResponsesRequest) -> None:
    """The text rules of every string field (router/protocol.py's `check_text`) for the fields the response echoes
    or the chat request does not carry; the chat request built from it is then checked as any chat request."""
    for name in ("instructions", "user", "previous_response_id"):
        value = getattr(request, name)
        if value is not None:
            check_text(value, param=name)
    for name in ("metadata", "tools", "tool_choice", "text"):
        check_json_text(getattr(request, name), name)
