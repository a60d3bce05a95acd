"""Hostile request bodies against both OpenAI endpoints: every one is a 4xx in OpenAI's error shape, never a 5xx,
and none reaches a worker.

The bodies are written as raw bytes, so they can hold what no JSON library writes on purpose: bytes that are
not UTF-8, lone surrogates as \\u escapes, NaN and Infinity, numbers past float and int64 ranges.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from router.errors import ERROR_TYPES
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.server import RouterServer
from tests.router.conftest import MODEL, Cluster, info_of, serve_router
from tests.router.fake_worker import FakeWorker

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {COMPLETIONS: {"model": MODEL, "prompt": "hi"},
        CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}
SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800, as a hostile client would
MiB = 1024 * 1024


def with_fields(path: str, fields: str) -> bytes:
    """The endpoint's minimal valid body with `fields` (JSON text, e.g. '"n": 2') added; later keys win."""
    return f"{json.dumps(BASE[path])[:-1]}, {fields}}}".encode()


def with_value(path: str, **fields: object) -> bytes:
    return json.dumps({**BASE[path], **fields}).encode()


def post(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"Content-Type": "application/json"})


def assert_openai_error(response: httpx.Response, status: int | None = None, param: str | None = "any") -> None:
    """A 4xx (`status` exactly, if given) whose body is OpenAI's error object; `param` checked unless "any"."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert status is None or response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == response.status_code and error["type"] == ERROR_TYPES[response.status_code], error
    assert isinstance(error["message"], str) and error["message"], error
    assert param == "any" or error["param"] == param, error


# -- lone surrogates and NUL in every declared string field -----------------------------------------------------

# Each string field the request models declare (as /openapi.json names them, [] for a list item), the body that
# puts a lone surrogate there, and the param the 400 names ("model": an unknown model is a 404 first).
STRING_FIELDS: dict[str, dict[str, tuple[dict[str, object], str]]] = {
    COMPLETIONS: {
        "model": ({"model": SURROGATE}, "model"),
        "prompt": ({"prompt": f"a{SURROGATE}b"}, "prompt"),
        "prompt[]": ({"prompt": [SURROGATE]}, "prompt"),
        "stop": ({"stop": SURROGATE}, "stop"),
        "stop[]": ({"stop": ["ok", f"x{SURROGATE}"]}, "stop"),
        "bad_words[]": ({"bad_words": ["ok", f"x{SURROGATE}"]}, "bad_words"),
        "user": ({"user": SURROGATE}, "user"),
        "request_id": ({"request_id": SURROGATE}, "request_id"),
        "suffix": ({"suffix": SURROGATE}, "suffix"),
        "guided_json": ({"guided_json": SURROGATE}, "guided_json"),
        "guided_regex": ({"guided_regex": SURROGATE}, "guided_regex"),
        "guided_choice[]": ({"guided_choice": ["a", SURROGATE]}, "guided_choice"),
        "guided_grammar": ({"guided_grammar": SURROGATE}, "guided_grammar"),
    },
    CHAT: {
        "model": ({"model": SURROGATE}, "model"),
        "messages[].role": ({"messages": [{"role": SURROGATE, "content": "hi"}]}, "messages"),
        "messages[].content": ({"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
        "messages[].content[].type": ({"messages": [{"role": "user", "content": [{"type": SURROGATE}]}]},
                                      "messages"),
        "messages[].content[].text": (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, "messages"),
        "messages[].name": ({"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]}, "messages"),
        "stop": ({"stop": SURROGATE}, "stop"),
        "stop[]": ({"stop": [SURROGATE]}, "stop"),
        "bad_words[]": ({"bad_words": [SURROGATE]}, "bad_words"),
        "user": ({"user": SURROGATE}, "user"),
        "request_id": ({"request_id": SURROGATE}, "request_id"),
        "tool_choice": ({"tool_choice": SURROGATE}, "tool_choice"),
        "chat_template": ({"chat_template": SURROGATE}, "chat_template"),
        "guided_json": ({"guided_json": SURROGATE}, "guided_json"),
        "guided_regex": ({"guided_regex": SURROGATE}, "guided_regex"),
        "guided_choice[]": ({"guided_choice": ["a", SURROGATE]}, "guided_choice"),
        "guided_grammar": ({"guided_grammar": SURROGATE}, "guided_grammar"),
        "messages[].tool_call_id": (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": SURROGATE}]}, "messages"),
    },
}


def declared_string_fields(schema: dict, components: dict, prefix: str = "") -> set[str]:
    """The paths of the string fields a JSON schema declares (free-form objects have none)."""
    if "$ref" in schema:
        return declared_string_fields(components[schema["$ref"].rsplit("/", 1)[-1]], components, prefix)
    if "anyOf" in schema:
        return set().union(*(declared_string_fields(option, components, prefix) for option in schema["anyOf"]))
    if schema.get("type") == "string":
        return {prefix}
    if schema.get("type") == "array":
        return declared_string_fields(schema.get("items", {}), components, f"{prefix}[]")
    fields = schema.get("properties", {})
    return set().union(set(), *(declared_string_fields(field, components, f"{prefix}.{name}".lstrip("."))
                                for name, field in fields.items()))


@pytest.mark.parametrize(("path", "model"), [(COMPLETIONS, CompletionRequest), (CHAT, ChatCompletionRequest)])
def test_the_surrogate_table_covers_every_string_field(path: str, model: type) -> None:
    """A string field added to a request model must be added to STRING_FIELDS, so that it is tested."""
    schema = model.model_json_schema(ref_template="#/$defs/{model}")
    assert declared_string_fields(schema, schema.get("$defs", {})) == set(STRING_FIELDS[path])


@pytest.mark.parametrize(("path", "field"), [(path, field) for path, fields in STRING_FIELDS.items()
                                             for field in fields])
def test_lone_surrogate_in_any_string_field_is_4xx(cluster: Cluster, path: str, field: str) -> None:
    fields, param = STRING_FIELDS[path][field]
    body = with_value(path, **fields)
    assert b"\\ud800" in body
    response = post(cluster.client, path, body)
    assert_openai_error(response, 404 if field == "model" else 400, param)
    assert field == "model" or "lone surrogate" in response.json()["error"]["message"]
    assert cluster.decode.requests == []


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, b'{"model": "%s", "prompt": "\xed\xa0\x80"}' % MODEL.encode(), "prompt"),  # a surrogate as UTF-8
    (COMPLETIONS, b'{"model": "%s", "prompt": "\xff\xfe\xc3"}' % MODEL.encode(), None),  # not UTF-8 at all
    (CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "\xc0\xaf"}]}' % MODEL.encode(), None),
    (COMPLETIONS, b'{"model": "%s", "prompt": "hi", "stop": "\xed\xbf\xbf"}' % MODEL.encode(), "stop"),
])
def test_bytes_that_are_not_utf8_are_400(cluster: Cluster, path: str, body: bytes, param: str | None) -> None:
    assert_openai_error(post(cluster.client, path, body), 400, param)
    assert cluster.decode.requests == []


@pytest.mark.parametrize(("path", "fields"), [
    (COMPLETIONS, {"prompt": "a\x00b"}),
    (COMPLETIONS, {"prompt": ["\x00"]}),
    (CHAT, {"messages": [{"role": "user", "content": "a\x00"}]}),
    (CHAT, {"messages": [{"role": "us\x00er", "content": "hi"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "\x00"}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\x00"}]}]}),
])
def test_nul_in_prompt_text_is_400(cluster: Cluster, path: str, fields: dict[str, object]) -> None:
    response = post(cluster.client, path, with_value(path, **fields))
    assert_openai_error(response, 400, "prompt" if path == COMPLETIONS else "messages")
    assert "NUL" in response.json()["error"]["message"]
    assert cluster.decode.requests == []


# -- numbers: huge, negative, NaN, out of the vocabulary --------------------------------------------------------

HUGE = 2**70
SHARED_NUMBERS = [  # (JSON fields, the param named)
    ('"temperature": NaN', "temperature"), ('"temperature": Infinity', "temperature"),
    ('"temperature": -Infinity', "temperature"), ('"temperature": 1e400', "temperature"),
    ('"temperature": 1e300', "temperature"), ('"temperature": -1', "temperature"),
    ('"top_p": NaN', "top_p"), ('"top_p": 1e400', "top_p"), ('"min_p": -1e400', "min_p"),
    ('"repetition_penalty": Infinity', "repetition_penalty"), ('"repetition_penalty": 1e39', "repetition_penalty"),
    ('"repetition_penalty": -1', "repetition_penalty"), ('"presence_penalty": NaN', "presence_penalty"),
    ('"frequency_penalty": -1e400', "frequency_penalty"),
    (f'"top_k": {HUGE}', "top_k"), (f'"top_k": {2**31}', "top_k"), ('"top_k": -2', "top_k"),
    (f'"seed": {HUGE}', "seed"), (f'"seed": {-HUGE}', "seed"), (f'"seed": {2**64}', "seed"),
    (f'"n": {HUGE}', "n"), ('"n": -1', "n"), ('"n": 0', "n"), ('"n": 129', "n"),
    ('"logit_bias": {"1": 101}', "logit_bias"), ('"logit_bias": {"259": 1}', "logit_bias"),
    (f'"logit_bias": {{"{HUGE}": 1}}', "logit_bias"), ('"prompt_logprobs": 21', "prompt_logprobs"),
    (f'"min_tokens": {HUGE}', "min_tokens"), ('"min_tokens": -1', "min_tokens"),
    (f'"max_tokens": {HUGE}', "max_tokens"), (f'"max_tokens": {-HUGE}', "max_tokens"),
    ('"max_tokens": 0', "max_tokens"), ('"max_tokens": 1e400', "max_tokens"), ('"max_tokens": 2.5', "max_tokens"),
    (f'"stop_token_ids": [{HUGE}]', "stop_token_ids"), (f'"stop_token_ids": [{2**32}]', "stop_token_ids"),
    ('"stop_token_ids": [-1]', "stop_token_ids"), ('"stop_token_ids": [259]', "stop_token_ids"),
    ('"stop_token_ids": [1e400]', "stop_token_ids"),
]
COMPLETION_NUMBERS = [
    (f'"logprobs": {HUGE}', "logprobs"), ('"logprobs": -1', "logprobs"), (f'"best_of": {HUGE}', "best_of"),
    ('"prompt": [-1]', "prompt"), ('"prompt": [259]', "prompt"), (f'"prompt": [{HUGE}]', "prompt"),
    (f'"prompt": [[1, {-HUGE}]]', "prompt"), ('"prompt": [NaN]', "prompt"), ('"prompt": [1e400]', "prompt"),
]
CHAT_NUMBERS = [
    (f'"logprobs": true, "top_logprobs": {HUGE}', "top_logprobs"), ('"logprobs": true, "top_logprobs": -1',
                                                                    "top_logprobs"),
    (f'"max_completion_tokens": {-HUGE}', "max_completion_tokens"),
    (f'"max_completion_tokens": {HUGE}', "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "fields", "param"),
                         [(path, fields, param) for path in (COMPLETIONS, CHAT) for fields, param in SHARED_NUMBERS]
                         + [(COMPLETIONS, fields, param) for fields, param in COMPLETION_NUMBERS]
                         + [(CHAT, fields, param) for fields, param in CHAT_NUMBERS])
def test_absurd_numbers_are_400_naming_the_field(cluster: Cluster, path: str, fields: str, param: str) -> None:
    assert_openai_error(post(cluster.client, path, with_fields(path, fields)), 400, param)
    assert cluster.decode.requests == []


# -- wrong types, wrong shapes, empty and huge lists ------------------------------------------------------------

NOT_AN_OBJECT = [b"[1, 2]", b"3", b"null", b'"text"', b"true", b"", b"{", b'{"model": ', b"\xff", b"[" * 100_000,
                 b'{"a":' * 100_000, b"{}", b'{"model": "%s"}' % MODEL.encode()]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("body", NOT_AN_OBJECT, ids=lambda body: repr(body[:12]))
def test_garbage_bodies_are_400(cluster: Cluster, path: str, body: bytes) -> None:
    assert_openai_error(post(cluster.client, path, body), 400)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml"])
def test_bodies_not_sent_as_json_are_400(cluster: Cluster, path: str, content_type: str) -> None:
    body = json.dumps(BASE[path]).encode()
    assert_openai_error(cluster.client.post(path, content=body, headers={"Content-Type": content_type}), 400)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fields", [f'"top_k": {HUGE}', '"temperature": NaN', '"user": "\\ud800"'])
def test_a_bad_stream_request_is_a_400_not_an_event(cluster: Cluster, path: str, fields: str) -> None:
    response = post(cluster.client, path, with_fields(path, f'"stream": true, {fields}'))
    assert response.headers["content-type"] == "application/json"
    assert_openai_error(response, 400)


def nested(depth: int = 500) -> str:
    """Lists in lists: deep, yet shallow enough for Python's json to parse (the 100_000 deep bodies above are
    not)."""
    return "[" * depth + "]" * depth


SHARED_SHAPES = [
    '"model": 5', '"model": null', '"stream": "maybe"', '"stream_options": 5',
    '"stream_options": {"include_usage": []}', '"stop": 5', '"stop": [5]', '"stop": {"a": 1}',
    '"stop": ' + json.dumps(["x"] * 65), '"stop": "' + "x" * 5000 + '"',
    '"stop_token_ids": "x"', '"stop_token_ids": ' + json.dumps(list(range(2000))), '"temperature": "hot"',
    '"temperature": []', '"n": "two"', '"logit_bias": {"x": 1}', '"logit_bias": {"1": NaN}', '"logit_bias": 5',
    '"ignore_eos": {}', '"user": 5', f'"stop": {nested()}', '"bad_words": "x"', '"bad_words": [5]',
    '"bad_words": ' + json.dumps(["x"] * 1025), '"bad_words": ["' + "x" * 5000 + '"]', '"bad_words": [" "]',
    '"bad_words": ["x"], "guided_regex": "a+"',
]
COMPLETION_SHAPES = [
    '"prompt": 5', '"prompt": {"a": 1}', '"prompt": null', '"prompt": [1.5]', '"prompt": [1, "a"]', '"prompt": []',
    '"prompt": [[]]', '"prompt": [[1], []]', '"prompt": ' + json.dumps(["a"] * 10_000),
    '"prompt": ' + json.dumps([65] * 100_000), '"prompt": "' + "x" * 100_000 + '"', '"best_of": 2, "stream": true',
    '"suffix": "s"', f'"prompt": {nested()}', '"logprobs": "x"',
]
CHAT_SHAPES = [
    '"messages": "hi"', '"messages": []', '"messages": [5]', '"messages": [{"role": 5}]', '"messages": [{}]',
    '"messages": [{"role": "user", "content": 5}]', '"messages": [{"role": "user", "content": [5]}]',
    '"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
    '"messages": [{"role": "user", "content": [{"text": "no type"}]}]',
    '"messages": ' + json.dumps([{"role": "user", "content": "hi"}] * 10_000),
    f'"tools": [{nested()}]', f'"tools": [{{"a": {nested()}}}]',
    f'"response_format": {{"type": "json_schema", "json_schema": {{"schema": {nested()}}}}}',
    '"response_format": {"type": "yaml"}', '"top_logprobs": 2', '"logprobs": "x"', '"tool_choice": 5',
    '"response_format": {"type": "json_schema"}', '"tool_choice": {"type": "function"}', '"guided_choice": []',
    '"guided_json": 5', '"structured_outputs": 5', '"structured_outputs": {"choice": "a"}',
    '"tools": [{"type": "function", "function": {"name": ""}}]',
]


@pytest.mark.parametrize(("path", "fields"),
                         [(path, fields) for path in (COMPLETIONS, CHAT) for fields in SHARED_SHAPES]
                         + [(COMPLETIONS, fields) for fields in COMPLETION_SHAPES]
                         + [(CHAT, fields) for fields in CHAT_SHAPES], ids=lambda value: str(value)[:40])
def test_wrong_types_and_shapes_are_4xx(cluster: Cluster, path: str, fields: str) -> None:
    assert_openai_error(post(cluster.client, path, with_fields(path, fields)))
    assert cluster.decode.requests == []


# -- body size ------------------------------------------------------------------------------------------------

def prompt_body(path: str, num_bytes: int) -> bytes:
    """A body of exactly `num_bytes` holding one long prompt (text or chat message)."""
    head, tail = with_value(path, **({"prompt": ""} if path == COMPLETIONS else
                                     {"messages": [{"role": "user", "content": ""}]})).split(b'""', 1)
    return head + b'"' + b"x" * (num_bytes - len(head) - len(tail) - 2) + b'"' + tail


def post_chunked(client: httpx.Client, path: str, body: bytes, chunk_size: int = MiB) -> httpx.Response:
    """POST `body` chunked (Transfer-Encoding: chunked, no Content-Length), as a generator body makes httpx."""
    chunks = (body[start:start + chunk_size] for start in range(0, len(body), chunk_size))
    return client.post(path, content=chunks, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def small_limit_router(  # type: ignore[no-untyped-def]
    fakes: dict[str, FakeWorker], tokenizer
) -> Iterator[RouterServer]:
    """A router over the same fakes that takes bodies of 1 MiB at most."""
    server = serve_router([info_of(fakes["prefill-0"]), info_of(fakes["decode-0"])], tokenizer,
                          max_request_body_bytes=MiB)
    yield server
    server.stop()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_bodies_over_the_default_limit_are_413(cluster: Cluster, path: str) -> None:
    """32 MiB by default: a 10 MB body is read (and its prompt refused as too long), a 40 MB one is not."""
    assert_openai_error(post(cluster.client, path, prompt_body(path, 10_000_000)), 400,
                        "prompt" if path == COMPLETIONS else "messages")
    body = prompt_body(path, 40_000_000)
    response = post(cluster.client, path, body)
    assert_openai_error(response, 413, None)
    assert "40000000 bytes" in response.json()["error"]["message"]
    assert_openai_error(post_chunked(cluster.client, path, body), 413, None)
    assert cluster.decode.requests == []


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_limit_is_configurable_and_exact(small_limit_router: RouterServer, cluster: Cluster, path: str) -> None:
    with httpx.Client(base_url=small_limit_router.url, timeout=60.0) as client:
        response = post(client, path, prompt_body(path, 10_000_000))
        assert_openai_error(response, 413, None)
        assert "over this server's limit of 1048576 bytes" in response.json()["error"]["message"]
        assert_openai_error(post_chunked(client, path, prompt_body(path, 10_000_000)), 413, None)
        assert_openai_error(post_chunked(client, path, prompt_body(path, MiB + 1), 4096), 413, None)
        # At the limit the body is parsed (the prompt is then too long for the context), and after each 413 the
        # connection was still good for the next request.
        param = "prompt" if path == COMPLETIONS else "messages"
        assert_openai_error(post(client, path, prompt_body(path, MiB)), 400, param)
        assert_openai_error(post_chunked(client, path, prompt_body(path, MiB), 4096), 400, param)
        assert post_chunked(client, path, with_fields(path, '"max_tokens": 2'), 7).status_code == 200
    assert cluster.decode.wait_for(lambda worker: len(worker.requests) == 1)
