"""Errors come back in OpenAI's shape with the right status: 400 for bad input (never a 500), 404 for unknown
routes and models, 503 when no worker can take the request, and the workers' failures mapped to HTTP or to
stream events."""

from __future__ import annotations

import grpc
import httpx
import pytest

from router.worker_registry import WorkerInfo
from tests.router.conftest import MODEL, Cluster, dead_endpoint, info_of, serve_router, sse_payloads
from tests.router.fake_worker import FakeWorker, Script

CHAT = [{"role": "user", "content": "Hi"}]


def assert_error(response: httpx.Response, status: int, param: str | None = None, fragment: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param, error
    assert fragment in error["message"], error["message"]
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                             503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}[status]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"temperature": -0.5}, "temperature", "temperature must be >= 0"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ({"n": 129}, "n", "n must be in [1, 128]"),
        ({"n": 3, "best_of": 2}, "best_of", "best_of must be in [n=3, 128]"),
        ({"best_of": 2, "stream": True}, "best_of", "not supported with stream"),
        ({"prompt": "x" * 64}, "prompt", "maximum context length is 64"),
        ({"prompt": "x" * 60, "max_tokens": 10}, "max_tokens", "you requested 70 tokens"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
        ({"prompt": None}, "prompt", ""),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": ["a"] * 1025}, "prompt", "a batch holds at most 1024 prompts, got 1025"),
        ({"prompt": ["a", ""]}, "prompt", "must not be empty"),
        ({"prompt": [1, 100000]}, "prompt", "prompt token ids must be in [0, 259)"),
        ({"temperature": "hot"}, "temperature", ""),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
        ({"stop": ["ok", ""]}, "stop", "stop strings must be non-empty"),
        ({"seed": 2**64}, "seed", "seed must be in"),
        ({"suffix": "s"}, "suffix", "suffix is not supported"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"300": 1.0}}, "logit_bias", "logit_bias token ids must be in [0, 259)"),
        ({"echo": True, "logprobs": 2, "prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in"),
    ],
)
def test_completion_bad_input_is_400(cluster: Cluster, body: dict, param: str, fragment: str) -> None:
    request = {"model": MODEL, "prompt": "hello", **body}
    request = {key: value for key, value in request.items() if value is not None}
    assert_error(cluster.client.post("/v1/completions", json=request), 400, param, fragment)
    assert cluster.decode.requests == []


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"messages": []}, "messages", ""),
        ({"messages": [{"content": "no role"}]}, "messages", ""),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text parts"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "logprobs must be in [0, 20]"),
        ({"max_completion_tokens": 1000}, "max_completion_tokens", "maximum context length"),
        ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema' object"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output constraint"),
        ({"stream": True, "n": 0}, "n", "n must be in [1, 128]"),
    ],
)
def test_chat_bad_input_is_400(cluster: Cluster, body: dict, param: str, fragment: str) -> None:
    response = cluster.client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body})
    assert_error(response, 400, param, fragment)
    assert cluster.decode.requests == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(cluster: Cluster, path: str) -> None:
    """As vLLM and OpenAI answer it (their clients raise NotFoundError), before any work is dispatched."""
    body = {"model": "gpt-4", "prompt": "hello", "messages": CHAT}
    assert_error(cluster.client.post(path, json=body), 404, "model", "'gpt-4' does not exist")
    assert cluster.decode.requests == []


def test_malformed_and_missing_bodies_are_400(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                                   headers={"content-type": "application/json"})
    assert_error(response, 400, None, "not valid JSON")
    assert_error(cluster.client.post("/v1/completions", json={"model": MODEL}), 400, "prompt", "Field required")
    assert_error(cluster.client.post("/v1/chat/completions", json={"prompt": "x"}), 400, "model")
    assert_error(cluster.client.post("/v1/completions", json=[1, 2]), 400)
    assert_error(cluster.client.post("/v1/completions", content=b""), 400)


def test_unknown_route_is_404_and_wrong_method_405(cluster: Cluster) -> None:
    assert_error(cluster.client.get("/v1/nothing"), 404, None, "Not Found")
    response = cluster.client.get("/v1/completions")
    assert response.status_code == 405 and response.json()["error"]["code"] == 405


@pytest.mark.parametrize(
    ("status", "http_status"),
    [(grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
     (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
     (grpc.StatusCode.INTERNAL, 500)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_worker_status_codes_map_to_http(cluster: Cluster, status: grpc.StatusCode, http_status: int,
                                         stream: bool) -> None:
    cluster.decode.script = Script(status=status)
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
    assert_error(response, http_status, None, f"scripted {status.name}")


@pytest.mark.parametrize(
    ("script", "status", "fragment"),
    [(Script(error_after=0), 500, "scripted failure"), (Script(abort_after=0), 503, "aborted")],
)
def test_error_message_before_any_token(cluster: Cluster, script: Script, status: int, fragment: str) -> None:
    cluster.decode.script = script
    for stream in (False, True):  # before the first byte: a status either way
        response = cluster.client.post("/v1/chat/completions",
                                       json={"model": MODEL, "messages": CHAT, "stream": stream})
        assert_error(response, status, None, fragment)


def test_an_abort_before_any_token_is_counted_as_a_failure_not_a_finish(cluster: Cluster) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> dict[tuple[str, str], float]:
        families = text_string_to_metric_families(cluster.client.get("/metrics").text)
        return {(s.name, next(iter(s.labels.values()), "")): s.value for f in families for s in f.samples
                if s.name in ("splitserve:request_failure_total", "splitserve:request_success_total")}

    cluster.decode.script = Script(abort_after=0)
    before = counts()
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert_error(response, 503, None, "worker decode-0 aborted the request before its first token")
    after = counts()
    assert after.get(("splitserve:request_failure_total", "worker_aborted"), 0) == (
        before.get(("splitserve:request_failure_total", "worker_aborted"), 0) + 1)
    assert after[("splitserve:request_success_total", "abort")] == before[("splitserve:request_success_total", "abort")]


@pytest.mark.parametrize("script", [Script(error_after=2), Script(abort_after=2)])
def test_failure_mid_stream_is_an_error_event(cluster: Cluster, script: Script) -> None:
    cluster.decode.script = script
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    assert response.status_code == 200
    *chunks, error_event, done = sse_payloads(response.text)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "He"
    assert set(error_event) == {"error"} and error_event["error"]["code"] in (500, 503)
    assert done == "[DONE]"
    # Non-streaming, the same failure after some tokens is a plain error.
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code in (500, 503) and "error" in response.json()


def test_no_workers_is_503(tokenizer) -> None:
    server = serve_router([], tokenizer)
    try:
        with httpx.Client(base_url=server.url) as client:
            assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503, None,
                         "no healthy decode worker")
            assert_error(client.get("/health"), 503, None, "no healthy prefill or decode worker")
            # Not ready, yet alive: the liveness probe (/live) must not restart a gateway that has no workers.
            assert client.get("/live").json() == {"status": "live"}
            # Bad input is still a 400 when nothing could serve it anyway.
            assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 2}), 400,
                         "top_p")
    finally:
        server.stop()


def test_unreachable_worker_is_503(fakes: dict[str, FakeWorker], tokenizer) -> None:
    dead = WorkerInfo(worker_id="decode-dead", role="decode", endpoint=dead_endpoint())
    server = serve_router([info_of(fakes["prefill-0"]), dead], tokenizer)
    try:
        with httpx.Client(base_url=server.url) as client:
            response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
            assert_error(response, 503, None, "no healthy decode worker")
            assert client.get("/health").status_code == 503
    finally:
        server.stop()


def test_unavailable_during_generate_retries_on_another_worker(fakes: dict[str, FakeWorker], tokenizer) -> None:
    for fake in fakes.values():
        fake.reset()
    flaky, good = fakes["decode-0"], fakes["decode-1"]
    flaky.script = Script(status=grpc.StatusCode.UNAVAILABLE)
    good.load.num_requests_running = 3  # the flaky one looks idler, so it is tried first
    server = serve_router([info_of(fakes["prefill-0"]), info_of(flaky), info_of(good)], tokenizer)
    try:
        with httpx.Client(base_url=server.url) as client:
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == "He"
            assert len(flaky.requests) == 1 and len(good.requests) == 1
            assert flaky.requests[0].request_id == good.requests[0].request_id
    finally:
        server.stop()


def test_failed_kv_handoff_is_retried_on_another_prefill_worker(fakes: dict[str, FakeWorker], tokenizer) -> None:
    """ABORTED before any token (the decode worker got no KV) goes out again, steered to the other prefill
    worker; retried once, counted in splitserve:request_retries_total."""
    for fake in fakes.values():
        fake.reset()
    decode = fakes["decode-0"]
    decode.script = Script(status=grpc.StatusCode.ABORTED, status_times=1)
    other_prefill = FakeWorker(worker_id="prefill-1", role="prefill")
    other_prefill.reset()
    server = serve_router([info_of(fakes["prefill-0"]), info_of(other_prefill), info_of(decode)], tokenizer)
    try:
        with httpx.Client(base_url=server.url) as client:
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == "He"
            first, second = decode.requests
            assert first.request_id == second.request_id
            assert {first.prefill_endpoint, second.prefill_endpoint} == {fakes["prefill-0"].endpoint,
                                                                         other_prefill.endpoint}
            metrics = client.get("/metrics").text
            assert 'splitserve:request_retries_total{reason="aborted"} 1.0' in metrics
    finally:
        server.stop()
        other_prefill.stop()


def test_kv_handoff_failing_on_every_attempt_is_503(fakes: dict[str, FakeWorker], tokenizer) -> None:
    for fake in fakes.values():
        fake.reset()
    decode = fakes["decode-0"]
    decode.script = Script(status=grpc.StatusCode.ABORTED)
    server = serve_router([info_of(fakes["prefill-0"]), info_of(decode)], tokenizer)
    try:
        with httpx.Client(base_url=server.url) as client:
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert_error(response, 503, None, "scripted ABORTED")
            assert len(decode.requests) == 2  # max_dispatch_attempts, both to the only pair there is
            assert decode.requests[0].prefill_endpoint == decode.requests[1].prefill_endpoint
            assert client.get("/health").status_code == 200  # a failed handoff says nothing of the workers' health
            assert 'splitserve:request_failure_total{reason="kv_transfer"} 1.0' in client.get("/metrics").text
    finally:
        server.stop()
