"""Admission control through HTTP, on fake workers: a full pool queues requests in order, refuses beyond the queue
with 429 + Retry-After, times queued requests out with 503, and forgets a client that left while queued. A load
poll that times out leaves the worker routable (busy is not dead)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest

from router.server import RouterServer
from tests.router.conftest import MODEL, info_of, serve_router
from tests.router.fake_worker import FakeWorker, Script
from tests.router.test_metrics_and_status import scrape, value

BODY = {"model": MODEL, "prompt": "abc", "max_tokens": 4}


QUEUE_TIMEOUT_S = 5.0  # the one-slot router's: a request that waited in its queue is answered only after it


@pytest.fixture
def one_slot(fakes: dict[str, FakeWorker], tokenizer) -> Iterator[tuple[FakeWorker, RouterServer]]:  # type: ignore[no-untyped-def]
    """A router over a decode worker that runs one request at a time; the first request hangs after a token."""
    for worker in fakes.values():
        worker.reset()
    prefill, decode = fakes["prefill-0"], fakes["decode-0"]
    decode.load.max_num_seqs = 1
    decode.script = Script(hang_after=1)
    server = serve_router([info_of(prefill), info_of(decode)], tokenizer, max_queued_requests=1,
                          queue_timeout_s=QUEUE_TIMEOUT_S)
    yield decode, server
    server.stop()
    for worker in fakes.values():
        worker.reset()


class _Holder:
    """A streamed request that got its first token and now holds the pool's only slot, until `close()`."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=30.0)
        request = self.client.build_request("POST", "/v1/completions", json={**BODY, "stream": True})
        self.response = self.client.send(request, stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()  # kept: a dropped iterator would close the connection
        next(self.lines)

    def close(self) -> None:
        self.response.close()
        self.client.close()


def queue_one(client: httpx.Client, *, wait_s: float) -> Callable[[float], httpx.Response]:
    """Send a completion that must queue (the pool's slot is held), wait until the gateway counts it queued, and
    return a join: `join(timeout_s)` waits for its response."""
    results: dict[str, httpx.Response] = {}
    url = str(client.base_url)
    queued = threading.Thread(target=lambda: results.setdefault(
        "queued", httpx.post(f"{url}/v1/completions", json=BODY, timeout=30.0)))
    queued.start()
    deadline = time.monotonic() + wait_s
    while value(scrape(client), "splitserve:admission_queue_requests") != 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)

    def join(timeout_s: float) -> httpx.Response:
        queued.join(timeout_s)
        return results["queued"]

    return join


def test_a_full_pool_queues_then_refuses_with_429(one_slot) -> None:  # type: ignore[no-untyped-def]
    decode, server = one_slot
    holder = _Holder(server.url)
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        join_queued = queue_one(client, wait_s=5.0)
        assert len(decode.requests) == 1  # the queued request reached no worker

        started = time.monotonic()
        refused = client.post("/v1/completions", json=BODY)
        # at once: not after waiting out the queue (a loaded machine may take a while to answer, never that long)
        assert time.monotonic() - started < QUEUE_TIMEOUT_S
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        error = refused.json()["error"]
        assert error["code"] == 429 and "capacity" in error["message"]

        decode.script = Script()  # the next request completes
        holder.close()  # the holder goes away: its slot frees, the queued request goes
        queued = join_queued(10.0)
        assert queued.status_code == 200, queued.text
        samples = scrape(client)
        assert value(samples, "splitserve:admission_rejections_total", reason="queue_full") == 1
        assert value(samples, "splitserve:admission_queue_requests") == 0
        assert value(samples, "splitserve:admission_in_flight_requests") == 0
        assert value(samples, "splitserve:admission_queue_time_seconds_count") >= 2
        assert value(samples, "splitserve:request_failure_total", reason="queue_full") == 1


def test_a_request_queued_too_long_gets_503_with_retry_after(fakes, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = fakes["prefill-0"], fakes["decode-0"]
    for worker in fakes.values():
        worker.reset()
    decode.load.max_num_seqs = 1
    decode.script = Script(hang_after=1)
    server = serve_router([info_of(prefill), info_of(decode)], tokenizer, queue_timeout_s=0.5)
    try:
        holder = _Holder(server.url)
        started = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30.0)
        assert response.status_code == 503 and 0.4 < time.monotonic() - started < 5.0
        assert int(response.headers["Retry-After"]) >= 1
        assert "waited" in response.json()["error"]["message"]
        holder.close()
    finally:
        server.stop()
        for worker in fakes.values():
            worker.reset()


def test_a_client_that_leaves_the_queue_is_forgotten(one_slot) -> None:  # type: ignore[no-untyped-def]
    decode, server = one_slot
    holder = _Holder(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=0.5)
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        deadline = time.monotonic() + 5.0
        while value(scrape(client), "splitserve:admission_queue_requests") != 0:
            assert time.monotonic() < deadline, "the departed client is still queued"
            time.sleep(0.05)
        decode.script = Script()
        holder.close()
        assert client.post("/v1/completions", json=BODY).status_code == 200
        assert len(decode.requests) == 2  # the departed request never reached a worker


def test_a_load_poll_that_times_out_leaves_the_worker_routable(cluster) -> None:  # type: ignore[no-untyped-def]
    cluster.decode.load_status = grpc.StatusCode.DEADLINE_EXCEEDED  # as a GetLoad that answers too late
    samples = scrape(cluster.client)
    assert value(samples, "splitserve:worker_healthy", worker="decode-0") == 1
    response = cluster.client.post("/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    health = cluster.client.get("/health").json()
    assert {w["worker_id"]: w["healthy"] for w in health["workers"]}["decode-0"] is True
