"""Request migration (router/migration.py, router/resumable_stream.py): the pure parts on exact values, then the
gateway over fake workers, one of which goes away mid-stream."""

from __future__ import annotations

import dataclasses
import time

import grpc
import httpx
import pytest

from engine.request.sampling_params import SamplingParams
from engine.tokenizer.detokenizer import IncrementalDetokenizer
from protos import serving_pb2
from router.migration import (
    SERVER_CANCELLED,
    STREAM_CUT,
    WORKER_UNAVAILABLE,
    TextContinuation,
    resume_request,
    worker_gone,
)
from tests.router.conftest import MODEL, info_of, serve_router, sse_payloads
from tests.router.fake_worker import FakeWorker, Script, token_ids_of

# -- which failures mean the worker is gone --------------------------------------------------------------------


@pytest.mark.parametrize(("code", "details", "reason"), [
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", WORKER_UNAVAILABLE),
    (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls", WORKER_UNAVAILABLE),
    (grpc.StatusCode.UNKNOWN, "Stream removed", STREAM_CUT),
    (grpc.StatusCode.CANCELLED, "Cancelled on the server side", SERVER_CANCELLED),
    (grpc.StatusCode.UNKNOWN, "Exception iterating responses: boom", None),  # the worker's own bug
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt too long", None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", None),
    (grpc.StatusCode.INTERNAL, "bug", None),
    (grpc.StatusCode.ABORTED, "KV handoff failed", None),
])
def test_worker_gone(code: grpc.StatusCode, details: str, reason: str | None) -> None:
    assert worker_gone(code, details) == reason


# -- the resumed request ---------------------------------------------------------------------------------------


def test_the_resumed_request_carries_the_streamed_tokens_and_what_is_left() -> None:
    params = SamplingParams(temperature=0.7, seed=42, max_tokens=10, min_tokens=4, stop=["x"], stop_token_ids=[7],
                            logprobs=2)
    resumed = resume_request(request_id="cmpl-1", prompt_token_ids=[1, 2, 3], params=params,
                             streamed_token_ids=[9, 8, 7, 6, 5, 4], num_migrations=2)
    assert resumed is not None
    assert resumed.request_id == "cmpl-1-m2"
    assert resumed.prompt_token_ids == [1, 2, 3, 9, 8, 7, 6, 5, 4]
    assert resumed.num_prior_tokens == 6
    assert resumed.params.max_tokens == 4 and resumed.params.min_tokens == 0
    assert resumed.params == dataclasses.replace(params, max_tokens=4, min_tokens=0)  # the rest: unchanged
    assert params.max_tokens == 10 and params.min_tokens == 4  # the original is left alone


def test_an_unset_max_tokens_stays_unset_and_min_tokens_shrinks() -> None:
    params = SamplingParams(max_tokens=None, min_tokens=5)
    resumed = resume_request(request_id="r", prompt_token_ids=[1], params=params, streamed_token_ids=[2, 3],
                             num_migrations=1)
    assert resumed is not None
    assert resumed.params.max_tokens is None and resumed.params.min_tokens == 3


def test_nothing_is_left_to_resume_once_max_tokens_were_streamed() -> None:
    params = SamplingParams(max_tokens=3)
    assert resume_request(request_id="r", prompt_token_ids=[1], params=params, streamed_token_ids=[2, 3, 4],
                          num_migrations=1) is None


# -- the text after a migration --------------------------------------------------------------------------------


def _worker_text(tokenizer, params: SamplingParams, token_ids: list[int]) -> str:  # type: ignore[no-untyped-def]
    """What one undisturbed worker streams for `token_ids` (its add_token deltas, then finish)."""
    detokenizer = IncrementalDetokenizer(tokenizer, stop=tuple(params.stop),
                                         include_stop_str_in_output=params.include_stop_str_in_output)
    text = "".join(detokenizer.add_token(token_id) for token_id in token_ids)
    return text + (detokenizer.finish() if not detokenizer.stopped else "")


@pytest.mark.parametrize("stop", [[], ["lo w"], ["é!"]])
def test_every_migration_point_continues_the_text_exactly(tokenizer, stop: list[str]) -> None:
    """Before the cut, the first worker's deltas (what it held back never went out); after it, the gateway's.
    Together they equal the undisturbed text — across a 2-byte character and a stop string split at the cut."""
    params = SamplingParams(stop=stop)
    token_ids = token_ids_of("Hello wé! done")
    expected = _worker_text(tokenizer, params, token_ids)
    for cut in range(len(token_ids)):
        first = IncrementalDetokenizer(tokenizer, stop=tuple(stop))
        text = "".join(first.add_token(token_id) for token_id in token_ids[:cut])
        if first.stopped:
            assert text == expected
            continue
        continuation = TextContinuation(tokenizer, params, token_ids[:cut])
        stop_str = None
        for token_id in token_ids[cut:]:
            step = continuation.step([token_id])
            text += step.text_delta
            if step.stop_str is not None:
                stop_str = step.stop_str
                break
        else:
            text += continuation.finish()
        assert text == expected, cut
        assert stop_str == (stop[0] if stop else None)  # not stopped before the cut: found after it


def test_a_stop_string_across_the_cut_keeps_only_the_tokens_up_to_it(tokenizer) -> None:
    params = SamplingParams(stop=["wor"])
    continuation = TextContinuation(tokenizer, params, token_ids_of("Hello wo"))  # "wo" was held back
    step = continuation.step(token_ids_of("rld"))
    assert (step.text_delta, step.num_tokens_kept, step.stop_str) == ("", 1, "wor")
    params.include_stop_str_in_output = True
    continuation = TextContinuation(tokenizer, params, token_ids_of("Hello wo"))
    assert continuation.step(token_ids_of("rld")).text_delta == "wor"


# -- the gateway over fake workers -----------------------------------------------------------------------------


@pytest.fixture
def two_decode(fakes: dict[str, FakeWorker], tokenizer):  # type: ignore[no-untyped-def]
    for worker in fakes.values():
        worker.reset()
    prefill, first, second = fakes["prefill-0"], fakes["decode-0"], fakes["decode-1"]
    first.load.kv_blocks_free = 100
    second.load.kv_blocks_free = 50  # decode-0 is chosen first: the idlest
    servers = []

    def serve(**config: object) -> httpx.Client:
        server = serve_router([info_of(prefill), info_of(first), info_of(second)], tokenizer,
                              routing_policy="least-loaded", **config)
        servers.append(server)
        return httpx.Client(base_url=server.url, timeout=30.0)

    yield serve, first, second
    for server in servers:
        server.stop()


def _metric(client: httpx.Client, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {next(iter(s.labels.values()), ""): s.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for s in family.samples if s.name == name}


@pytest.mark.parametrize("cut_status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_stream_whose_worker_goes_away_resumes_on_another(two_decode, cut_status: grpc.StatusCode) -> None:
    serve, first, second = two_decode
    client = serve()
    first.script = Script(text="Hello world", cut_after=4, cut_status=cut_status)
    second.script = Script(text="o world")  # what decode-1 generates after "Hell"
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 11, "min_tokens": 6, "seed": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    payloads = sse_payloads(client.post("/v1/completions", json=body).text)
    assert payloads[-1] == "[DONE]"
    usage = payloads[-2]["usage"]
    text = "".join(p["choices"][0]["text"] for p in payloads[:-2])
    assert text == "Hello world"
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 11)
    assert payloads[-3]["choices"][0]["finish_reason"] == "stop"
    (original,), (resumed,) = first.requests, second.requests
    assert list(resumed.prompt_token_ids) == list(original.prompt_token_ids) + token_ids_of("Hell")
    assert resumed.request_id == original.request_id + "-m1"
    assert (resumed.params.max_tokens, resumed.params.min_tokens, resumed.params.seed) == (7, 2, 3)
    assert resumed.prefill_endpoint  # prefilled again, through the prefill worker
    reason = {grpc.StatusCode.UNAVAILABLE: WORKER_UNAVAILABLE, grpc.StatusCode.CANCELLED: SERVER_CANCELLED}
    assert _metric(client, "splitserve:request_migrations_total") == {reason[cut_status]: 1.0}
    assert _metric(client, "splitserve:request_success_total").get("stop") == 1.0
    assert not _metric(client, "splitserve:request_failure_total")
    # Non-streaming: the same, in one body.
    first.script = Script(text="Hello world", cut_after=4, cut_status=cut_status)
    client.get("/metrics")  # a poll: decode-0 answers GetLoad, so it is healthy again
    response = client.post("/v1/completions", json={**body, "stream": False})
    assert response.json()["choices"][0]["text"] == "Hello world", response.text


def test_past_max_migrations_the_client_gets_an_error_event(two_decode) -> None:
    serve, first, second = two_decode
    client = serve(max_migrations=1)
    first.script = Script(text="Hello world", cut_after=4)
    second.script = Script(text="o world", cut_after=2)
    payloads = sse_payloads(client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 11,
                                                                  "stream": True}).text)
    *chunks, error_event, done = payloads
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Hello "
    assert error_event["error"]["code"] == 503 and "--max-migrations 1" in error_event["error"]["message"]
    assert done == "[DONE]"
    assert _metric(client, "splitserve:request_failure_total") == {"migration_limit": 1.0}
    assert _metric(client, "splitserve:request_migrations_total") == {WORKER_UNAVAILABLE: 1.0}


def test_with_max_migrations_0_a_lost_worker_ends_the_stream_with_an_error(two_decode) -> None:
    serve, first, second = two_decode
    client = serve(max_migrations=0)
    first.script = Script(text="Hello world", cut_after=4)
    *chunks, error_event, _done = sse_payloads(client.post("/v1/completions", json={
        "model": MODEL, "prompt": "ab", "max_tokens": 11, "stream": True}).text)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Hell"
    assert "went away mid-stream" in error_event["error"]["message"]
    assert not second.requests


def test_a_request_error_mid_stream_is_not_migrated(two_decode) -> None:
    serve, first, second = two_decode
    client = serve()
    first.script = Script(text="Hello world", cut_after=4, cut_status=grpc.StatusCode.INTERNAL)
    *_, error_event, _done = sse_payloads(client.post("/v1/completions", json={
        "model": MODEL, "prompt": "ab", "max_tokens": 11, "stream": True}).text)
    assert error_event["error"]["code"] == 500 and not second.requests
    assert _metric(client, "splitserve:request_failure_total") == {"worker_error": 1.0}


def test_a_client_that_leaves_after_a_migration_aborts_the_request_on_the_new_worker(two_decode) -> None:
    serve, first, second = two_decode
    client = serve()
    first.script = Script(text="Hello world", cut_after=4)
    second.script = Script(text="o world", hang_after=2)
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 11,
                                                         "stream": True}) as response:
        text = ""
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                text += json.loads(line[6:])["choices"][0]["text"]
            if text == "Hello ":
                break
    assert second.wait_for(lambda w: w.cancelled and w.aborts)
    (resumed,) = second.requests
    assert second.cancelled == [resumed.request_id] and second.aborts == [resumed.request_id]
    deadline = time.monotonic() + 5
    while _metric(client, "splitserve:request_success_total").get("abort") != 1.0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_stop_string_across_the_migration_ends_the_request_at_the_gateway(two_decode) -> None:
    serve, first, second = two_decode
    client = serve()
    # "Hello w" streamed. A real worker would hold "w" back (it may start "wor"); the fake sends every byte at once,
    # so the client has "Hello w" here (the exact text around a cut is checked on the detokenizer, above).
    first.script = Script(text="Hello world", cut_after=7)
    second.script = Script(text="orld and more", hang_after=5)  # goes on until cancelled
    payloads = sse_payloads(client.post("/v1/completions", json={
        "model": MODEL, "prompt": "ab", "max_tokens": 30, "stop": ["wor"], "stream": True,
        "stream_options": {"include_usage": True}}).text)
    *chunks, usage_chunk, _done = payloads
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Hello w"
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "wor")
    assert usage_chunk["usage"]["completion_tokens"] == 9  # "Hello w" + "or"
    assert second.wait_for(lambda w: w.cancelled and w.aborts)  # the gateway ended it: blocks freed there
    success = _metric(client, "splitserve:request_success_total")
    assert (success["stop"], success.get("abort", 0.0)) == (1.0, 0.0)  # counted once, as the stop it was


_DYING_SERVER = """
import asyncio
import grpc.aio
from protos import serving_pb2, serving_pb2_grpc

class Servicer(serving_pb2_grpc.WorkerServicer):
    async def Generate(self, request, context):
        for i in range(10_000):
            yield serving_pb2.GenerateResponse(token_ids=[i])
            await asyncio.sleep(0.01)

async def main():
    server = grpc.aio.server()
    serving_pb2_grpc.add_WorkerServicer_to_server(Servicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_a_sigkilled_worker_process_reads_as_gone() -> None:
    """What a real process killed under a live stream looks like to the gateway's grpc.aio client."""
    import asyncio
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import grpc.aio

    from protos import serving_pb2_grpc

    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen([sys.executable, "-c", _DYING_SERVER], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        port = process.stdout.readline().strip()  # type: ignore[union-attr]

        async def read_until_killed() -> grpc.aio.AioRpcError:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = serving_pb2_grpc.WorkerStub(channel).Generate(serving_pb2.GenerateRequest(), timeout=30)
                for num_read in range(1, 10_000):
                    try:
                        await call.read()
                    except grpc.aio.AioRpcError as error:
                        return error
                    if num_read == 5:
                        process.send_signal(signal.SIGKILL)
            raise AssertionError("the stream outlived its server")

        error = asyncio.run(read_until_killed())
        assert worker_gone(error.code(), error.details() or "") is not None, (error.code(), error.details())
    finally:
        process.kill()
        process.wait()


def test_a_stream_on_a_worker_that_leaves_the_list_resumes_on_another(fakes, tokenizer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The controller gives a silent worker up (it leaves the list): the gateway closes its channel after a grace,
    which cancels the calls still open on it under the gateway's feet. Such a call is the worker going away, not the
    client: the stream resumes on another decode worker. (Found on several hosts, tests/multihost/: the cancelled
    read raised asyncio.CancelledError through the SSE response, which the HTTP server cut short — "ASGI callable
    returned without completing response".)"""
    import router.worker_registry as worker_registry

    monkeypatch.setattr(worker_registry, "_CHANNEL_CLOSE_GRACE_S", 0.3)
    for worker in fakes.values():
        worker.reset()
    prefill, first, second = fakes["prefill-0"], fakes["decode-0"], fakes["decode-1"]
    first.load.kv_blocks_free = 100
    second.load.kv_blocks_free = 50  # decode-0 is chosen first
    first.script = Script(text="Hello world", hang_after=4)  # then silent, as behind a cut link
    second.script = Script(text="o world")
    listed = [info_of(prefill), info_of(first), info_of(second)]
    server = serve_router(listed, tokenizer, routing_policy="least-loaded")
    try:
        client = httpx.Client(base_url=server.url, timeout=30.0)
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 11, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = []
            for line in lines:
                received.append(line)
                if sum(line.startswith("data: {") for line in received) == 4:
                    break
            listed.remove(info_of(first))  # the controller's list no longer has decode-0
            received += list(lines)
        payloads = sse_payloads("\n\n".join(line for line in received if line))
        assert payloads[-1] == "[DONE]"
        assert "".join(p["choices"][0]["text"] for p in payloads[:-1]) == "Hello world"
        assert len(second.requests) == 1
        assert _metric(client, "splitserve:request_migrations_total") == {SERVER_CANCELLED: 1.0}
    finally:
        server.stop()
