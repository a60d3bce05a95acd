"""A client that goes away cancels its request on the worker: the Generate call is cancelled and Abort sent."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import MODEL, Cluster
from tests.router.fake_worker import Script
from tests.router.test_metrics_and_status import scrape, value


def _cancelled_and_aborted(cluster: Cluster) -> str:
    assert cluster.decode.wait_for(lambda fake: len(fake.requests) == 1)
    request_id = cluster.decode.requests[0].request_id
    assert cluster.decode.wait_for(lambda fake: request_id in fake.cancelled and request_id in fake.aborts), (
        cluster.decode.cancelled, cluster.decode.aborts)
    return request_id


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream(cluster: Cluster, path: str) -> None:
    aborted_before = value(scrape(cluster.client), "splitserve:request_success_total", finished_reason="abort")
    cluster.decode.script = Script(text="x" * 40, hang_after=3)
    body = {"model": MODEL, "stream": True, "max_tokens": 40}
    body.update({"prompt": "p"} if "chat" not in path else {"messages": [{"role": "user", "content": "p"}]})
    with httpx.Client(base_url=cluster.url, timeout=10.0) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            events = response.iter_lines()
            assert next(line for line in events if line.startswith("data:"))
    # Leaving the blocks closed the response and its connection, mid-stream.
    _cancelled_and_aborted(cluster)
    aborted = value(scrape(cluster.client), "splitserve:request_success_total", finished_reason="abort")
    assert aborted == aborted_before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_waiting_for_the_worker(cluster: Cluster, stream: bool) -> None:
    # Non-streaming: the router waits for the whole answer; streaming: for the first token. Either way the
    # client gives up first.
    cluster.decode.script = Script(text="x" * 40, hang_after=0 if stream else 2)
    with httpx.Client(base_url=cluster.url, timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "stream": stream})
    _cancelled_and_aborted(cluster)


def test_finished_requests_are_not_aborted(cluster: Cluster) -> None:
    assert cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "p"}).status_code == 200
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True})
    assert response.text.endswith("data: [DONE]\n\n")
    assert cluster.decode.wait_for(lambda fake: len(fake.requests) == 2)
    assert not cluster.decode.wait_for(lambda fake: fake.aborts or fake.cancelled, timeout_s=0.3)
