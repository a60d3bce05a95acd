"""The gateway's side of structured outputs and tool calls, torch-free: the spec a request asks for (and the 400s),
the tool plan, its grammar, and parsing the model's output into OpenAI tool calls, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from router.errors import ApiError
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.structured import structured_outputs_of
from router.tools import ToolPlan, plan_tools, tool_messages

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize(("fields", "kind", "source"), [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json_schema",
     json.dumps(SCHEMA)),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}}, "json_schema", json.dumps(SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
    ({"response_format": {"type": "text"}}, None, None),
])
def test_each_way_of_asking_gives_its_spec(fields: dict[str, object], kind: str | None, source: str | None) -> None:
    for request in (chat(**fields), CompletionRequest(model="m", prompt="p", **fields)):
        spec = structured_outputs_of(request)
        assert (spec.kind, spec.source) == (kind, source) if spec is not None else kind is None


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output constraint"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "object"}, "guided_regex": "x"}, "guided_regex", "one structured output"),
    ({"guided_regex": ""}, "guided_regex", "guided_regex regex is empty"),
    ({"structured_outputs": {"xml": "x"}}, "structured_outputs", "unsupported constraint 'xml'"),
    ({"guided_regex": "\ud800"}, "guided_regex", "lone surrogate"),
])
def test_bad_or_doubled_specs_are_400s_naming_the_field(fields: dict[str, object], param: str, message: str
                                                        ) -> None:
    with pytest.raises(ApiError) as error:
        request = chat(**fields)
        from router.protocol import check_chat_request

        check_chat_request(request)
        structured_outputs_of(request)
    assert error.value.status_code == 400 and error.value.param == param
    assert message in error.value.message


def test_tool_plans() -> None:
    assert plan_tools(chat()) is None
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none")) is None
    auto = plan_tools(chat(tools=[WEATHER, TIME]))
    assert auto is not None and auto.mode == "auto" and auto.structured_outputs() is None
    named = plan_tools(chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                "function": {"name": "get_time"}}))
    assert named is not None and named.structured_outputs().source == json.dumps(TIME["function"]["parameters"])
    for choice, message in [({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
                            ("sometimes", "tool_choice must be")]:
        with pytest.raises(ApiError, match=message):
            plan_tools(chat(tools=[WEATHER], tool_choice=choice))
    with pytest.raises(ApiError, match="unique"):
        plan_tools(chat(tools=[WEATHER, WEATHER]))
    with pytest.raises(ApiError, match="needs tools"):
        plan_tools(chat(tool_choice="required"))


def test_required_grammar_admits_exactly_calls_of_the_tools() -> None:
    plan = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert plan is not None
    schema = json.loads(plan.structured_outputs().source)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"city": "Oslo"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = plan.parser().parse('[{"name": "get_time", "parameters": {"zone": "CET"}}]')
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "CET"})]


AUTO_OUTPUT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')


def streamed(plan: ToolPlan, text: str, size: int) -> tuple[str, list[dict[str, object]]]:
    """Feed `text` `size` characters at a time; the content and the calls OpenAI's client would assemble."""
    parser = plan.parser()
    pieces = [p for i in range(0, len(text), size) for p in parser.feed(text[i: i + size])] + parser.finish()
    content = "".join(p.get("content", "") for p in pieces)
    calls: dict[int, dict[str, str]] = {}
    for piece in pieces:
        for delta in piece.get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"name": "", "arguments": "", "id": ""})
            call["id"] += delta.get("id", "")
            call["name"] += delta.get("function", {}).get("name", "")
            call["arguments"] += delta["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_auto_calls_parse_whole_and_streamed_alike(size: int) -> None:
    plan = plan_tools(chat(tools=[WEATHER, TIME]))
    content, calls = plan.parser().parse(AUTO_OUTPUT)
    assert content == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    stream_content, stream_calls = streamed(plan, AUTO_OUTPUT, size)
    assert stream_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in stream_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    assert all(c["id"].startswith("call_") for c in stream_calls)


@pytest.mark.parametrize("text", [
    "no calls at all, just a < sign and <tool",
    "<tool_call>{not json}</tool_call> after",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "argu',  # cut by max_tokens
])
def test_auto_output_that_is_not_a_call_comes_back_as_content(text: str) -> None:
    plan = plan_tools(chat(tools=[WEATHER]))
    assert plan.parser().parse(text) == (text, [])
    assert streamed(plan, text, 2) == (text, [])


def test_an_unclosed_last_call_still_parses() -> None:
    plan = plan_tools(chat(tools=[WEATHER]))
    _, calls = plan.parser().parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


def test_named_output_streams_as_arguments() -> None:
    plan = plan_tools(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    text = '{"city": "Paris"}'
    content, calls = streamed(plan, text, 4)
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == text
    assert plan.parser().parse(text)[1][0]["function"] == {"name": "get_weather", "arguments": text}


def test_tool_turns_and_the_tool_prompt_render_as_text() -> None:
    request = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    plan = plan_tools(request)
    rendered = [{"role": m.role, "content": m.content or ""} for m in request.messages]
    messages = tool_messages(request, rendered, plan)
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                      '</tool_call>')
    assert messages[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
