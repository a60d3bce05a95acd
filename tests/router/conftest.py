"""Fixtures for the router's tests: the byte tokenizer, fake workers, and a router served by real uvicorn.

The session's cluster is one prefill and one decode fake behind a disaggregated router; tests that need other
shapes (colocated, no workers, several decode workers) build their own router over the same fakes.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from engine.tokenizer.tokenizer import Tokenizer
from router.app import create_app
from router.config import RouterConfig
from router.api_keys import AccessControl
from router.server import GatewayTls, RouterServer
from router.worker_registry import WorkerInfo, WorkerRegistry
from tests.router.fake_worker import FakeWorker, byte_tokenizer

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 64


@dataclass
class Cluster:
    prefill: FakeWorker
    decode: FakeWorker
    server: RouterServer
    client: httpx.Client
    tokenizer: Tokenizer

    @property
    def url(self) -> str:
        return self.server.url


def info_of(worker: FakeWorker) -> WorkerInfo:
    return WorkerInfo(worker_id=worker.worker_id, role=worker.role, endpoint=worker.endpoint)


def serve_router(
    workers: list[WorkerInfo], tokenizer: Tokenizer, *, mode: str = "disaggregated",
    access: AccessControl | None = None, tls: GatewayTls | None = None, **config: object
) -> RouterServer:
    config.setdefault("disagg_prefill_threshold_tokens", 0)  # every prompt through a prefill worker
    config.setdefault("max_model_len", MAX_MODEL_LEN)
    router_config = RouterConfig(served_model_names=(MODEL,), mode=mode, **config)  # type: ignore[arg-type]
    registry = WorkerRegistry(lambda: workers, refresh_interval_s=0.5, load_timeout_s=1.0)
    return RouterServer(create_app(router_config, registry, tokenizer, access=access), tls=tls).start()


def dead_endpoint() -> str:
    """A local address nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return byte_tokenizer()


@pytest.fixture(scope="session")
def fakes() -> Iterator[dict[str, FakeWorker]]:
    workers = {name: FakeWorker(worker_id=name, role=role)
               for name, role in [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"),
                                  ("colocated-0", "colocated")]}
    for worker in workers.values():
        worker.reset()
    yield workers
    for worker in workers.values():
        worker.stop()


@pytest.fixture(scope="session")
def session_cluster(fakes: dict[str, FakeWorker], tokenizer: Tokenizer) -> Iterator[Cluster]:
    prefill, decode = fakes["prefill-0"], fakes["decode-0"]
    server = serve_router([info_of(prefill), info_of(decode)], tokenizer)
    client = httpx.Client(base_url=server.url, timeout=30.0)
    yield Cluster(prefill=prefill, decode=decode, server=server, client=client, tokenizer=tokenizer)
    client.close()
    server.stop()


@pytest.fixture
def cluster(session_cluster: Cluster, fakes: dict[str, FakeWorker]) -> Cluster:
    """The session cluster with every fake reset to its default script and load, and the router's view of them
    refreshed (a scrape polls every worker: a test that made one look down must not leak into the next)."""
    for worker in fakes.values():
        worker.reset()
    session_cluster.client.get("/metrics").raise_for_status()
    return session_cluster


@pytest.fixture
def serve_gateway(fakes: dict[str, FakeWorker], tokenizer: Tokenizer) -> Iterator:
    """`serve_gateway(**config)`: a client of a new disaggregated router over the fake prefill-0 and decode-0
    (reset first), with `config`'s settings (`access` too); every router is stopped after the test."""
    servers: list[RouterServer] = []

    def start(**config: object) -> httpx.Client:
        for worker in fakes.values():
            worker.reset()
        server = serve_router([info_of(fakes["prefill-0"]), info_of(fakes["decode-0"])], tokenizer,
                              **config)  # type: ignore[arg-type]
        servers.append(server)
        return httpx.Client(base_url=server.url, timeout=30.0)

    yield start
    for server in servers:
        server.stop()


def sse_payloads(body: str) -> list[object]:
    """The `data:` payloads of an SSE body: parsed JSON, or the string "[DONE]"."""
    import json

    events = [event for event in body.split("\n\n") if event]
    payloads: list[object] = []
    for event in events:
        assert event.startswith("data: "), event
        data = event[len("data: "):]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
