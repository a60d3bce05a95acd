"""OpenAI's Responses API (`POST /v1/responses`, stateless) through the official `openai` client, unmodified, against
the router (fake workers behind it): the prompt is the chat completion's of the same conversation, the answer
comes back in the Responses shapes, whole and streamed, text, tool calls and structured outputs; what a stateless
server cannot do is a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from tests.router.conftest import MODEL, Cluster
from tests.router.fake_worker import Script

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALLS = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=30.0)


@pytest.fixture
def long_context(serve_gateway, fakes) -> tuple[openai.OpenAI, object]:  # type: ignore[no-untyped-def]
    """A client of a gateway whose context holds a tool prompt, and its decode worker."""
    http = serve_gateway(max_model_len=4096)
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", max_retries=0, timeout=30.0), http


def _chat_prompt(http, decode, messages: list[dict[str, object]],  # type: ignore[no-untyped-def]
                 **fields: object) -> list[int]:
    """The prompt the decode worker got for the chat completion of `messages`."""
    answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1, **fields})
    assert answer.status_code == 200, answer.text
    return list(decode.requests[-1].prompt_token_ids)


def test_a_text_answer_is_the_chat_completions_of_the_same_conversation(client: openai.OpenAI,
                                                                          cluster: Cluster) -> None:
    response = client.responses.create(model=MODEL, input="Say hi", instructions="Be brief", max_output_tokens=5,
                                       temperature=0.0, metadata={"run": "7"})
    prompt = list(cluster.decode.requests[-1].prompt_token_ids)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == "Hello" and response.status == "incomplete"  # max_output_tokens cut it
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 5
    assert response.usage.total_tokens == response.usage.input_tokens + 5 and response.metadata == {"run": "7"}
    assert cluster.decode.requests[-1].params.temperature == 0.0
    assert prompt == _chat_prompt(cluster.client, cluster.decode, [{"role": "system", "content": "Be brief"},
                                            {"role": "user", "content": "Say hi"}])
    done = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hi"}]}])
    assert done.status == "completed" and done.output_text == "Hello world" and done.incomplete_details is None


def test_a_stream_is_the_responses_event_sequence(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Say hi", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello world" and len(deltas) > 1
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.output_text == "Hello world"
    assert final.usage is not None and final.usage.output_tokens == 11
    assert events[-2].item.content[0].text == "Hello world"  # type: ignore[union-attr]


def test_included_logprobs_are_the_chat_logprobs_whole_and_streamed(client: openai.OpenAI,
                                                                      cluster: Cluster) -> None:
    chat = cluster.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5, "logprobs": True,
        "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    response = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=5, top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert [entry.model_dump() for entry in part.logprobs] == chat and len(chat) == 5
    assert part.logprobs[0].token == "H" and len(part.logprobs[0].top_logprobs) == 2
    assert cluster.decode.requests[-1].params.logprobs == 2
    plain = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=5)
    assert not plain.output[0].content[0].logprobs  # type: ignore[union-attr]  # not included: none computed
    assert not cluster.decode.requests[-1].params.HasField("logprobs")
    events = list(client.responses.create(model=MODEL, input="Say hi", max_output_tokens=5, top_logprobs=2,
                                          include=["message.output_text.logprobs"], stream=True))
    streamed = [entry.model_dump() for event in events if event.type == "response.output_text.delta"
                for entry in event.logprobs]  # type: ignore[union-attr]
    assert streamed == chat
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [entry.model_dump() for entry in done.logprobs] == chat  # type: ignore[union-attr]


def test_tool_calls_come_back_as_function_call_items_whole_and_streamed(  # type: ignore[no-untyped-def]
    long_context, fakes,
) -> None:
    client, _ = long_context
    fakes["decode-0"].script = Script(text=CALLS, finish_reason="stop")
    response = client.responses.create(model=MODEL, input="Weather in Oslo and Rome?", tools=[WEATHER])
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Oslo"}),
                                                                          ("get_weather", {"city": "Rome"})]
    assert response.output[0].type == "message" and response.output_text == "Checking. "
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo and Rome?", tools=[WEATHER],
                                          stream=True))
    streamed = [event.item for event in events if event.type == "response.output_item.done"
                and event.item.type == "function_call"]  # type: ignore[union-attr]
    assert [(item.name, json.loads(item.arguments)) for item in streamed] == [  # type: ignore[union-attr]
        (call.name, json.loads(call.arguments)) for call in calls]
    arguments = "".join(event.delta for event in events  # type: ignore[union-attr]
                        if event.type == "response.function_call_arguments.delta")
    assert arguments == "".join(call.arguments for call in calls)


def test_tool_turns_in_input_render_as_the_chat_tool_turns(long_context, fakes) -> None:  # type: ignore[no-untyped-def]
    client, http = long_context
    client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="auto", input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    prompt = list(fakes["decode-0"].requests[-1].prompt_token_ids)
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert prompt == _chat_prompt(http, fakes["decode-0"], [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], tools=tools, tool_choice="auto")


def test_text_format_is_structured_output_and_vllm_fields_pass(client: openai.OpenAI, cluster: Cluster) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "s",
                                                                      "schema": schema}},
                            extra_body={"top_k": 3, "seed": 5})
    params = cluster.decode.requests[-1].params
    assert params.structured_outputs.kind == "json_schema" and json.loads(params.structured_outputs.source) == schema
    assert (params.top_k, params.seed) == (3, 5)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": 5}]}, "input"),
    ({"input": [{"role": "user", "content": ["x"]}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"text": {"format": 5}}, "text"),
    ({"tool_choice": {"type": "function", "name": 5}}, "tool_choice"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"instructions": "\ud800"}, "instructions"),
    ({"metadata": {"k": "\ud800"}}, "metadata"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(cluster: Cluster, fields: dict[str, object],
                                                          param: str) -> None:
    body = json.dumps({"model": MODEL, "input": "hi", **fields})  # ASCII: a lone surrogate travels escaped
    answer = cluster.client.post("/v1/responses", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param and cluster.decode.requests == []


def test_a_stream_that_fails_ends_with_response_failed(cluster: Cluster) -> None:
    cluster.decode.script = Script(error_after=2)
    answer = cluster.client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    events = [json.loads(line[len("data: "):]) for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"]
    missing = cluster.client.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert missing.status_code == 404
