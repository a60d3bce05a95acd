"""/openapi.json describes what the endpoints accept, and a schemathesis fuzz driven by it finds no 5xx.

The fuzz runs in process. The schema is read from /openapi.json at import (schemathesis's pytest integration
needs it to generate the tests), served by an app that is never started; the calls go to a second app, over
the same fake workers as the other router tests, that schemathesis calls directly on an event loop of its own,
where it also runs the app's lifespan (the worker registry and its gRPC channels).

Two fuzzes, each generating bodies that fit its schema and bodies that break it (wrong types, missing fields,
values out of range), plus the boundary values of schemathesis's coverage phase:
- the served schema as it is: it gives types, not ranges, so nearly every body breaks some rule at once;
- the served schema with the ranges the router accepts written in (`ACCEPTED`): its valid bodies reach the
  workers, and each invalid one breaks one rule of an otherwise good body, the value that must then get
  through the router's checks to the protobuf fields (a top_k past int32, a temperature past float32).

Bounded and deterministic: a fixed number of examples, `derandomize` (the seed derives from the test) and no
example database, so each run sends the same ~2700 bodies; about 20 s on 2 cores for both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from router.app import create_app
from router.config import RouterConfig
from router.errors import ERROR_TYPES
from router.worker_registry import WorkerInfo, WorkerRegistry
from tests.router.conftest import MAX_MODEL_LEN, MODEL, Cluster, info_of
from tests.router.fake_worker import FakeWorker, byte_tokenizer

schemathesis = pytest.importorskip("schemathesis")  # the `test` extra installs it
from schemathesis.python.asgi import shutdown_lifespans  # noqa: E402

ENDPOINTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}


def fuzz_settings(max_examples: int) -> hypothesis.settings:
    """Deterministic and bounded: the seed derives from the test, no example database, no deadline; and no
    health check, whose timing-based ones could fail a run on a busy machine."""
    return hypothesis.settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck))


def router_app(workers: Callable[[], list[WorkerInfo]]) -> FastAPI:
    config = RouterConfig(served_model_names=(MODEL,), max_model_len=MAX_MODEL_LEN,
                          disagg_prefill_threshold_tokens=0)  # every prompt through a prefill worker
    registry = WorkerRegistry(workers, refresh_interval_s=0.5, load_timeout_s=1.0)
    return create_app(config, registry, byte_tokenizer())


# Without `with`, the test client does not run the lifespan: nothing starts, no worker is asked.
OPENAPI = TestClient(router_app(lambda: [])).get("/openapi.json").json()


def _optional(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


_TOKEN_ID = _integer(0, byte_tokenizer().vocab_size - 1)
_TEXT = {"type": "string", "minLength": 1, "maxLength": 8}
_FLOAT32_MAX = 3.4028234663852886e38
# What the router accepts (SamplingParams.validate(), check_*_request, the protobuf fields, the byte tokenizer's
# vocabulary), at its exact edges where they are fixed, for the coverage phase to step just past them; the
# lengths kept small enough that a prompt and its completion fit the test context of 64 tokens.
ACCEPTED: dict[str, dict[str, Any]] = {
    "model": {"enum": [MODEL]},
    "temperature": _optional({"type": "number", "minimum": 0, "maximum": _FLOAT32_MAX}),
    "top_p": _optional({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _optional(_integer(-1, 2**31 - 1)),
    "min_p": _optional({"type": "number", "minimum": 0, "maximum": 1}),
    "seed": _optional(_integer(-(2**63), 2**64 - 1)),
    "presence_penalty": _optional({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _optional({"type": "number", "minimum": -2, "maximum": 2}),
    "repetition_penalty": _optional({"type": "number", "exclusiveMinimum": 0, "maximum": _FLOAT32_MAX}),
    "n": _integer(1, 3),
    "min_tokens": _integer(0, 1),
    "max_tokens": _optional(_integer(1, 8)),
    "stop": _optional({"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4}]}),
    "stop_token_ids": _optional({"type": "array", "items": _TOKEN_ID, "maxItems": 4}),
    "logit_bias": {"type": "null"},
    # completions
    "prompt": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 24},
                         {"type": "array", "items": _TOKEN_ID, "minItems": 1, "maxItems": 24}]},
    "logprobs": {"anyOf": [_integer(0, 5), {"type": "null"}, {"type": "boolean"}]},  # an int, or chat's bool
    "echo": {"type": "boolean"},
    "best_of": _optional(_integer(1, 3)),
    "suffix": {"type": "null"},
    # chat
    "messages": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["system", "user", "assistant"]},
            "content": {"anyOf": [_TEXT, {"type": "array", "maxItems": 2, "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": _TEXT}}}]}}}},
    "max_completion_tokens": _optional(_integer(1, 8)),
    "top_logprobs": {"type": "null"},
    "tools": {"type": "null"},
    "response_format": {"type": "null"},
    # structured outputs: their shapes are tested in test_structured_tools.py; compiling is the workers' part
    "guided_json": {"type": "null"},
    "guided_regex": {"type": "null"},
    "guided_choice": {"type": "null"},
    "guided_grammar": {"type": "null"},
    "structured_outputs": {"type": "null"},
}


def accepted_ranges(openapi: dict[str, Any]) -> dict[str, Any]:
    """`openapi` with ACCEPTED in place of each request property it names."""
    narrowed = copy.deepcopy(openapi)
    for model in ENDPOINTS.values():
        properties = narrowed["components"]["schemas"][model]["properties"]
        for name in properties.keys() & ACCEPTED.keys():
            properties[name] = ACCEPTED[name]
    return narrowed


def _endpoint(openapi: dict[str, Any], path: str) -> Any:
    return schemathesis.openapi.from_dict(openapi).include(path=path)


# One schema, and so one test, per endpoint: schemathesis gives the tests of one function the same node id whatever
# the operation, and pytest-xdist, which schedules by node id, would run only one of them.
ACCEPTED_OPENAPI = accepted_ranges(OPENAPI)
served_completions, served_chat = (_endpoint(OPENAPI, path) for path in ENDPOINTS)
accepted_completions, accepted_chat = (_endpoint(ACCEPTED_OPENAPI, path) for path in ENDPOINTS)
served_responses = _endpoint(OPENAPI, "/v1/responses")  # its input items are free-form objects: the parsing's part


def test_openapi_json_describes_both_endpoints(cluster: Cluster) -> None:
    response = cluster.client.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    assert schema == OPENAPI  # what the fuzz below reads
    for path, model in ENDPOINTS.items():
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    properties = [set(schema["components"]["schemas"][model]["properties"]) for model in ENDPOINTS.values()]
    assert ACCEPTED.keys() <= properties[0] | properties[1]  # no range written for a field that is gone
    completion = schema["components"]["schemas"]["CompletionRequest"]
    assert set(completion["required"]) == {"model", "prompt"}
    assert completion["properties"]["stop"]["anyOf"][1]["maxItems"] == 64
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"} and chat["properties"]["messages"]["minItems"] == 1
    for path in ENDPOINTS:  # the errors it answers with, in OpenAI's shape; no FastAPI 422 (a bad body is a 400)
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "413", "429", "503", "504"}, responses
        error_schema = responses["429"]["content"]["application/json"]["schema"]
        assert error_schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for page in ("/docs", "/redoc"):  # the schema only: no HTML pages
        assert cluster.client.get(page).status_code == 404


@pytest.fixture(scope="module")
def fuzzed_app(fakes: dict[str, FakeWorker]) -> Iterator[FastAPI]:
    """A router app over the session's fake prefill and decode workers; schemathesis runs its lifespan on the
    first call, and it is shut down here."""
    for worker in fakes.values():
        worker.reset()
    workers = [info_of(fakes["prefill-0"]), info_of(fakes["decode-0"])]
    yield router_app(lambda: workers)
    shutdown_lifespans()
    for worker in fakes.values():
        worker.reset()


def assert_not_a_server_error(response: Any) -> None:
    """Below 500, every error in OpenAI's shape."""
    assert response.status_code < 500, (response.status_code, response.text[:1000])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == response.status_code and error["type"] == ERROR_TYPES[response.status_code]


def _served_body_is_not_a_5xx(app: FastAPI, case: Any) -> None:
    """`model` is set to the served model in an object body: a random name is a 404 before anything else is
    looked at, and would hide every other field from the fuzz."""
    if isinstance(case.body, dict):
        case.body["model"] = MODEL
    assert_not_a_server_error(case.call(app=app))


@served_responses.parametrize()
@fuzz_settings(max_examples=80)
def test_no_responses_body_the_served_schema_generates_is_a_5xx(fuzzed_app: FastAPI, case: Any) -> None:
    _served_body_is_not_a_5xx(fuzzed_app, case)


@served_completions.parametrize()
@fuzz_settings(max_examples=120)
def test_no_completion_body_the_served_schema_generates_is_a_5xx(fuzzed_app: FastAPI, case: Any) -> None:
    _served_body_is_not_a_5xx(fuzzed_app, case)


@served_chat.parametrize()
@fuzz_settings(max_examples=120)
def test_no_chat_body_the_served_schema_generates_is_a_5xx(fuzzed_app: FastAPI, case: Any) -> None:
    _served_body_is_not_a_5xx(fuzzed_app, case)


served_tokenize, served_detokenize = (_endpoint(OPENAPI, path) for path in ("/tokenize", "/detokenize"))


@served_tokenize.parametrize()
@fuzz_settings(max_examples=80)
def test_no_tokenize_body_the_served_schema_generates_is_a_5xx(fuzzed_app: FastAPI, case: Any) -> None:
    _served_body_is_not_a_5xx(fuzzed_app, case)


@served_detokenize.parametrize()
@fuzz_settings(max_examples=40)
def test_no_detokenize_body_the_served_schema_generates_is_a_5xx(fuzzed_app: FastAPI, case: Any) -> None:
    _served_body_is_not_a_5xx(fuzzed_app, case)


@accepted_completions.parametrize()
@fuzz_settings(max_examples=300)
def test_no_completion_body_near_an_accepted_one_is_a_5xx(fuzzed_app: FastAPI, case: Any) -> None:
    assert_not_a_server_error(case.call(app=fuzzed_app))


@accepted_chat.parametrize()
@fuzz_settings(max_examples=300)
def test_no_chat_body_near_an_accepted_one_is_a_5xx(fuzzed_app: FastAPI, case: Any) -> None:
    assert_not_a_server_error(case.call(app=fuzzed_app))
