"""Completions and chat completions through the router, streamed and not, against a fake decode worker."""

from __future__ import annotations

import pytest

from tests.router.conftest import MODEL, Cluster, sse_payloads
from tests.router.fake_worker import Script, token_ids_of

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_completion(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi", "max_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32
    assert body["object"] == "text_completion" and body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # Disaggregated: the decode worker got the call, naming the prefill worker; the router's request id.
    (request,) = cluster.decode.requests
    assert request.request_id == body["id"]
    assert list(request.prompt_token_ids) == token_ids_of("Say hi")
    assert request.prefill_endpoint == cluster.prefill.endpoint
    assert request.params.max_tokens == 5
    assert request.router_queue_s > 0
    assert cluster.prefill.requests == []  # the decode worker, not the router, talks to the prefill worker


def test_completion_defaults_to_16_tokens_and_takes_token_ids(cluster: Cluster) -> None:
    cluster.decode.script = Script(text="x" * 40)
    body = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6, 7]]}).json()
    assert body["choices"][0]["text"] == "x" * 16 and body["usage"]["completion_tokens"] == 16
    assert list(cluster.decode.requests[0].prompt_token_ids) == [5, 6, 7]
    body = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": ["one"], "max_tokens": 1}).json()
    assert body["usage"]["prompt_tokens"] == 3


def test_sampling_params_reach_the_worker(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "p", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "seed": 2**64 - 1, "stop": "END", "stop_token_ids": [9], "ignore_eos": True,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 2,
    })
    assert response.status_code == 200, response.text
    params = cluster.decode.requests[0].params
    assert params.temperature == 0.5 and params.top_p == pytest.approx(0.9) and params.top_k == 20
    assert params.min_p == pytest.approx(0.05) and params.seed == -1  # 2**64 - 1 as int64
    assert list(params.stop) == ["END"] and list(params.stop_token_ids) == [9] and params.ignore_eos
    assert params.presence_penalty == 0.5 and params.frequency_penalty == -0.5
    assert params.repetition_penalty == pytest.approx(1.1) and params.min_tokens == 2
    assert not params.HasField("logprobs")


def test_completion_stream(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/completions",
                                   json={"model": MODEL, "prompt": "Say hi", "max_tokens": 5, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, done = sse_payloads(response.text)
    assert done == "[DONE]"
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Hello"
    assert {chunk["id"] for chunk in chunks} == {cluster.decode.requests[0].request_id}
    assert all(chunk["object"] == "text_completion" and "usage" not in chunk for chunk in chunks)
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * 4 + ["length"]


def test_completion_stream_usage_chunk(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Say hi", "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}})
    *chunks, usage_chunk, done = sse_payloads(response.text)
    assert done == "[DONE]"
    assert all(chunk["usage"] is None for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # the text ran out first: EOS
    assert usage_chunk["choices"] == [] and usage_chunk["id"] == chunks[0]["id"]
    assert usage_chunk["usage"] == {"prompt_tokens": 6, "completion_tokens": 11, "total_tokens": 17,
                                    "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello world"},
                                "logprobs": None, "finish_reason": "stop", "stop_reason": None}]
    prompt = cluster.tokenizer.apply_chat_template(CHAT)
    assert prompt.endswith("<|im_start|>assistant\n")
    request = cluster.decode.requests[0]
    assert list(request.prompt_token_ids) == cluster.tokenizer.encode(prompt, add_special_tokens=False)
    # Chat without max_tokens may use the whole context that the prompt leaves.
    assert request.params.max_tokens == 64 - len(request.prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == len(request.prompt_token_ids)


def test_chat_max_completion_tokens_and_text_parts(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    body = cluster.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 9, "max_completion_tokens": 2}).json()
    assert body["choices"][0]["message"]["content"] == "He"
    assert body["choices"][0]["finish_reason"] == "length"
    assert "a\nb" in cluster.tokenizer.decode(cluster.decode.requests[0].prompt_token_ids)


def test_chat_stream(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    first, *chunks, usage_chunk, done = sse_payloads(response.text)
    assert done == "[DONE]"
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == "Hel"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chunks, usage_chunk, done = sse_payloads(response.text)
    usages = [chunk["usage"] for chunk in chunks]
    prompt_tokens = usage_chunk["usage"]["prompt_tokens"]
    assert prompt_tokens > 0 and {u["prompt_tokens"] for u in usages} == {prompt_tokens}
    # the role chunk goes once the first token is out (the gateway waits for it), then one chunk per token
    assert [u["completion_tokens"] for u in usages] == [1, 1, 2, 3]
    assert all(u["total_tokens"] == prompt_tokens + u["completion_tokens"] for u in usages)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3
    plain = cluster.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert {chunk["usage"] is None for chunk in sse_payloads(plain.text)[:-2]} == {True}


def test_completion_logprobs(cluster: Cluster) -> None:
    body = cluster.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 2}).json()
    assert cluster.decode.requests[0].params.logprobs == 2
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["H", "e", "l"],
        "token_logprobs": [-0.25, -0.25, -0.25],
        "top_logprobs": [{"H": -0.25, "?": -1.5}, {"e": -0.25, "?": -1.5}, {"l": -0.25, "?": -1.5}],
        "text_offset": [0, 1, 2],
    }


def test_completion_logprobs_stream_offsets_continue(cluster: Cluster) -> None:
    response = cluster.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 3, "stream": True})
    *chunks, _ = sse_payloads(response.text)
    logprobs = [chunk["choices"][0]["logprobs"] for chunk in chunks]
    assert [lp["text_offset"] for lp in logprobs] == [[0], [1], [2]]
    # -inf is not JSON: floored at -9999.0, as vLLM does.
    assert logprobs[0]["top_logprobs"] == [{"H": -0.25, "?": -1.5, "!": -9999.0}]


def test_chat_logprobs(cluster: Cluster) -> None:
    body = cluster.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
    assert cluster.decode.requests[0].params.logprobs == 1
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {"token": "H", "logprob": -0.25, "bytes": [72], "top_logprobs": [
                {"token": "H", "logprob": -0.25, "bytes": [72]}]},
            {"token": "e", "logprob": -0.25, "bytes": [101], "top_logprobs": [
                {"token": "e", "logprob": -0.25, "bytes": [101]}]},
        ],
        "refusal": None,
    }
    body = cluster.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 1, "logprobs": True}).json()
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


@pytest.mark.parametrize(
    ("request_stop", "worker_stop_reason", "expected"),
    [({"stop": ["\n\n", "7"]}, "7", "7"), ({"stop_token_ids": [7]}, 7, 7), ({}, None, None),
     # a stop string and a stop token id that read alike stay apart: token 7 is reported as 7, not "7"
     ({"stop": ["7"], "stop_token_ids": [7]}, 7, 7), ({"stop": ["7"], "stop_token_ids": [7]}, "7", "7")],
)
def test_stop_reason_propagates(
    cluster: Cluster, request_stop: dict, worker_stop_reason: int | str | None, expected: int | str | None
) -> None:
    cluster.decode.script = Script(text="Hi", finish_reason="stop", stop_reason=worker_stop_reason)
    body = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **request_stop}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == expected
    response = cluster.client.post("/v1/chat/completions",
                                   json={"model": MODEL, "messages": CHAT, "stream": True, **request_stop})
    *_, last, done = sse_payloads(response.text)
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] == expected
