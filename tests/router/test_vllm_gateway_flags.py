"""vLLM's gateway flags and request fields of this file: request ids (the response's `id` from the X-Request-Id
header or the body's `request_id`, the workers' id the gateway's own whatever the client sent;
`--enable-request-id-headers` putting X-Request-Id on every response), `--root-path` for a path-routing proxy, and
`--return-tokens-as-token-ids` (and its request field) naming logprobs' tokens by id; the request fields
`return_token_ids`, `add_special_tokens`, `allowed_token_ids`, `bad_words` and chat's `echo`; the workers'
`--max-logprobs` as the gateway's cap; a request's own `chat_template` under `--trust-request-chat-template`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re

import httpx
import pytest

from engine.tokenizer.tokenizer import Tokenizer
from protos import serving_pb2
from router.errors import ApiError
from router.request_ids import response_id
from router.responses import ResponseHeader
from router.streaming import OutputSpec, sse_events
from tests.router.conftest import MODEL, info_of, serve_router, sse_payloads

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "abc", "max_tokens": 2}


def test_the_header_then_the_body_then_the_workers_id() -> None:
    assert response_id("cmpl", "from-header", "from-body", workers_id="cmpl-w") == "cmpl-from-header"
    assert response_id("chatcmpl", None, "from-body", workers_id="chatcmpl-w") == "chatcmpl-from-body"
    assert response_id("cmpl", None, None, workers_id="cmpl-w") == "cmpl-w"
    for bad in ("", "x" * 257, "tab\there", "é"):
        with pytest.raises(ApiError, match="1 to 256 printable ASCII characters"):
            response_id("cmpl", None, bad, workers_id="cmpl-w")


def test_the_response_id_is_the_clients_and_the_workers_id_is_not(  # type: ignore[no-untyped-def]
    serve_gateway, fakes,
) -> None:
    client = serve_gateway()
    answer = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-7"})
    assert answer.status_code == 200 and answer.json()["id"] == "cmpl-trace-7"
    assert "x-request-id" not in answer.headers  # the flag is off
    assert client.post("/v1/chat/completions", json={**CHAT, "request_id": "mine"}).json()["id"] == "chatcmpl-mine"
    streamed = client.post("/v1/chat/completions", json={**CHAT, "request_id": "mine", "stream": True})
    assert {chunk["id"] for chunk in sse_payloads(streamed.text) if isinstance(chunk, dict)} == {"chatcmpl-mine"}
    # Two clients may send the same id; the workers never see it.
    worker_ids = [request.request_id for request in fakes["decode-0"].requests]
    assert len(set(worker_ids)) == 3 and not any("trace-7" in rid or "mine" in rid for rid in worker_ids)
    refused = client.post("/v1/completions", json={**COMPLETION, "request_id": "x" * 300})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_id"


def test_every_response_carries_x_request_id_with_the_flag(serve_gateway) -> None:  # type: ignore[no-untyped-def]
    client = serve_gateway(enable_request_id_headers=True)
    answer = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-8"})
    assert answer.headers["x-request-id"] == "trace-8" and answer.json()["id"] == "cmpl-trace-8"
    fresh = client.post("/v1/completions", json=COMPLETION)
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
    assert fresh.json()["id"] == f"cmpl-{fresh.headers['x-request-id']}"  # the header and the id agree
    unknown = client.post("/v1/completions", json={**COMPLETION, "model": "nope"})
    assert unknown.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", unknown.headers["x-request-id"])
    assert client.get("/health").headers["x-request-id"]


def test_the_root_path_is_named_and_both_paths_serve(serve_gateway) -> None:  # type: ignore[no-untyped-def]
    client = serve_gateway(root_path="/llm")
    assert json.loads(client.get("/openapi.json").text)["servers"] == [{"url": "/llm"}]
    assert client.get("/llm/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get("/v1/models").status_code == 200  # a proxy that strips the prefix


def test_logprobs_name_tokens_by_id_with_the_flag_or_the_field(serve_gateway) -> None:  # type: ignore[no-untyped-def]
    client = serve_gateway(return_tokens_as_token_ids=True)
    body = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2, "logprobs": 2}).json()
    assert body["choices"][0]["logprobs"]["tokens"] == ["token_id:75", "token_id:104"]  # "H", "e"
    assert body["choices"][0]["logprobs"]["top_logprobs"][0] == {"token_id:75": -0.25, "token_id:66": -1.5}
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 11]  # as vLLM: the names' lengths
    chat = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1}).json()
    first = chat["choices"][0]["logprobs"]["content"][0]
    assert first == {"token": "token_id:75", "logprob": -0.25, "bytes": list(b"token_id:75"),
                     "top_logprobs": [{"token": "token_id:75", "logprob": -0.25, "bytes": list(b"token_id:75")}]}
    assert chat["choices"][0]["message"]["content"] == "He"  # the text itself is text
    off = client.post("/v1/completions", json={**COMPLETION, "logprobs": 0, "return_tokens_as_token_ids": False})
    assert off.json()["choices"][0]["logprobs"]["tokens"] == ["H", "e"]
    streamed = serve_gateway().post("/v1/completions", json={**COMPLETION, "logprobs": 0, "stream": True,
                                                     "return_tokens_as_token_ids": True})
    tokens = [chunk["choices"][0]["logprobs"]["tokens"] for chunk in sse_payloads(streamed.text)
              if isinstance(chunk, dict) and chunk["choices"] and chunk["choices"][0]["logprobs"]]
    assert tokens == [["token_id:75"], ["token_id:104"]]


def test_return_token_ids_gives_the_prompts_ids_and_each_choices(  # type: ignore[no-untyped-def]
    serve_gateway, fakes,
) -> None:
    client = serve_gateway()
    decode = fakes["decode-0"]
    plain = client.post("/v1/completions", json=COMPLETION).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    body = client.post("/v1/completions", json={**COMPLETION, "return_token_ids": True}).json()
    prompt_ids = list(decode.requests[-1].prompt_token_ids)
    assert body["choices"][0]["token_ids"] == [75, 104] and body["choices"][0]["prompt_token_ids"] == prompt_ids
    chat = client.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == list(decode.requests[-1].prompt_token_ids)  # on the body, as vLLM's
    assert chat["choices"][0]["token_ids"] == [75, 104]
    for path, request, where in (("/v1/completions", COMPLETION, "choice"), ("/v1/chat/completions", CHAT, "body")):
        streamed = client.post(path, json={**request, "return_token_ids": True, "stream": True})
        chunks = [chunk for chunk in sse_payloads(streamed.text) if isinstance(chunk, dict)]
        first = chunks[0] if where == "body" else chunks[0]["choices"][0]
        assert first["prompt_token_ids"] == list(decode.requests[-1].prompt_token_ids)  # once, on the first
        assert sum("prompt_token_ids" in (c if where == "body" else c["choices"][0]) for c in chunks) == 1
        assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == [75, 104]


def test_add_special_tokens_as_vllm_defaults_it(fakes, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Completions add the tokenizer's special tokens (a BOS) to a text prompt unless told not to; chat does not
    (its template writes them) unless told to."""
    bos = 0  # the byte tokenizer's <|endoftext|>, standing in for a BOS its model would add
    with_bos = Tokenizer(dataclasses.replace(tokenizer.spec, bos_token_id=bos, prefix_token_ids=(bos,)))
    worker = fakes["colocated-0"]
    worker.reset()
    server = serve_router([info_of(worker)], with_bos, mode="colocated")
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            for path, body in (("/v1/completions", COMPLETION),
                               ("/v1/completions", {**COMPLETION, "add_special_tokens": False}),
                               ("/v1/chat/completions", CHAT),
                               ("/v1/chat/completions", {**CHAT, "add_special_tokens": True})):
                assert client.post(path, json=body).status_code == 200
    finally:
        server.stop()
    assert [request.prompt_token_ids[0] == bos for request in worker.requests] == [True, False, False, True]


def test_chat_echo_opens_the_answer_with_the_assistants_last_message(  # type: ignore[no-untyped-def]
    serve_gateway,
) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {**CHAT, "messages": messages, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    client = serve_gateway()
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == "Once uponHe"
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    contents = [chunk["choices"][0]["delta"].get("content") for chunk in sse_payloads(streamed.text)
                if isinstance(chunk, dict) and chunk["choices"]]
    assert contents[1:] == ["Once uponH", "e"] and contents[0] == ""  # the role chunk, then the echo with the first
    after_user = client.post("/v1/chat/completions", json={**CHAT, "echo": True}).json()
    assert after_user["choices"][0]["message"]["content"] == "He"  # the last message is the user's: nothing to echo


def test_allowed_token_ids_reach_the_workers_and_bad_ones_are_400(  # type: ignore[no-untyped-def]
    serve_gateway, fakes,
) -> None:
    client = serve_gateway()
    assert client.post("/v1/completions", json={**COMPLETION, "allowed_token_ids": [75, 104]}).status_code == 200
    assert list(fakes["decode-0"].requests[-1].params.allowed_token_ids) == [75, 104]
    for ids, param in (([75, 10**6], "allowed_token_ids"), ([], None)):
        answer = client.post("/v1/chat/completions", json={**CHAT, "allowed_token_ids": ids})
        assert answer.status_code == 400 and (param is None or answer.json()["error"]["param"] == param)
    combined = client.post("/v1/chat/completions", json={**CHAT, "allowed_token_ids": [75], "guided_regex": "H+"})
    assert combined.status_code == 400 and combined.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_reach_the_workers_and_bad_ones_are_400(serve_gateway, fakes) -> None:  # type: ignore[no-untyped-def]
    client = serve_gateway()
    assert client.post("/v1/chat/completions", json={**CHAT, "bad_words": ["Hello", "once upon"]}).status_code == 200
    assert list(fakes["decode-0"].requests[-1].params.bad_words) == ["Hello", "once upon"]
    for words in (["ok", "  "], ["x" * 4097]):
        answer = client.post("/v1/completions", json={**COMPLETION, "bad_words": words})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "bad_words", answer.json()
    combined = client.post("/v1/completions", json={**COMPLETION, "bad_words": ["x"], "guided_choice": ["a", "b"]})
    assert combined.status_code == 400 and combined.json()["error"]["param"] == "bad_words"


def test_the_workers_max_logprobs_is_the_gateways_cap(serve_gateway, fakes) -> None:  # type: ignore[no-untyped-def]
    client = serve_gateway(max_logprobs=2)
    answer = client.post("/v1/completions", json={**COMPLETION, "logprobs": 3})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "logprobs"
    assert "--max-logprobs" in answer.json()["error"]["message"] and fakes["decode-0"].requests == []
    chat = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200 and fakes["decode-0"].requests[-1].params.logprobs == 2


def test_enable_log_requests_logs_each_request_once_cut_to_max_log_len(  # type: ignore[no-untyped-def]
    serve_gateway, fakes, caplog,
) -> None:
    caplog.set_level(logging.INFO, logger="router.request_log")
    quiet = serve_gateway()
    assert quiet.post("/v1/completions", json={**COMPLETION, "prompt": "secret prompt"}).status_code == 200
    assert not [r for r in caplog.records if r.name == "router.request_log"]  # off by default: prompts are data
    client = serve_gateway(enable_log_requests=True, max_log_len=6)
    answer = client.post("/v1/completions", json={**COMPLETION, "prompt": "secret prompt", "request_id": "r1"})
    assert answer.status_code == 200
    (record,) = [r for r in caplog.records if r.name == "router.request_log"]
    line = record.getMessage()
    assert line.startswith("Received request cmpl-r1") and "prompt: 'secret'" in line and "(of 13)" in line
    assert "temperature=" in line and "secret prompt" not in line


BRACKETS = "{% for m in messages %}[{{ m.content }}]{% endfor %}"


def test_a_requests_own_chat_template_only_when_trusted(  # type: ignore[no-untyped-def]
    serve_gateway, fakes, tokenizer,
) -> None:
    untrusted = serve_gateway()
    answer = untrusted.post("/v1/chat/completions", json={**CHAT, "chat_template": BRACKETS})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in answer.json()["error"]["message"] and fakes["decode-0"].requests == []
    client = serve_gateway(trust_request_chat_template=True)
    assert client.post("/v1/chat/completions", json={**CHAT, "chat_template": BRACKETS}).status_code == 200
    assert list(fakes["decode-0"].requests[-1].prompt_token_ids) == tokenizer.encode("[hi]", add_special_tokens=False)
    tokens = client.post("/tokenize", json={"messages": CHAT["messages"], "chat_template": BRACKETS}).json()
    assert tokens["tokens"] == tokenizer.encode("[hi]", add_special_tokens=False)
    plain = client.post("/v1/chat/completions", json=CHAT)  # the model's template when the request has none
    assert plain.status_code == 200 and list(fakes["decode-0"].requests[-1].prompt_token_ids) != tokens["tokens"]
    broken = client.post("/v1/chat/completions", json={**CHAT, "chat_template": "{% for m in messages %}"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
    assert "does not parse" in broken.json()["error"]["message"]


class _Messages:
    """A stream of scripted worker messages, as sse_events reads a ResumableStream."""

    num_prompt_tokens, num_completion_tokens, num_cached_tokens = 3, 0, 0

    def __init__(self, messages: list[serving_pb2.GenerateResponse]) -> None:
        self.messages = messages

    async def read(self) -> serving_pb2.GenerateResponse | None:
        return self.messages.pop(0) if self.messages else None

    def close(self) -> None:
        pass


def test_a_streamed_completions_prompt_ids_wait_for_its_first_chunk(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A first message with no text (a token whose text is held back) sends no chunk; the prompt's ids and that
    token's id go on the first chunk that is sent."""
    messages = [serving_pb2.GenerateResponse(token_ids=[7], text_delta=""),
                serving_pb2.GenerateResponse(token_ids=[8], text_delta="ab", finish_reason="length")]
    spec = OutputSpec(header=ResponseHeader(request_id="cmpl-1", created=0, model=MODEL, chat=False),
                      tokenizer=tokenizer, num_logprobs=None, prompt_token_ids=(4, 5, 6), return_token_ids=True)

    async def events() -> list[str]:
        return [event async for event in sse_events(_Messages(messages), spec)]  # type: ignore[arg-type]

    chunks = [json.loads(event.removeprefix("data: ")) for event in asyncio.run(events())[:-1]]
    assert [(c["choices"][0].get("prompt_token_ids"), c["choices"][0]["token_ids"]) for c in chunks] == [
        ([4, 5, 6], [7, 8])]
