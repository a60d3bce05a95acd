"""The cluster secret and mutual TLS on a real grpc.aio server (no model): what is refused never reaches the
handler; the channel factories present what the server requires."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import (
    METADATA_KEY,
    ClusterAuth,
    add_port,
    aio_channel,
    server_interceptors,
    sync_channel,
)
from tests.tls_certs import Certs, make_certs

SECRET = "cluster-secret-for-tests"


class CountingWorker(serving_pb2_grpc.WorkerServicer):
    """Counts the calls its handlers actually ran."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def Health(self, request: serving_pb2.HealthRequest, context: grpc.aio.ServicerContext
                     ) -> serving_pb2.HealthResponse:
        self.num_calls += 1
        return serving_pb2.HealthResponse(ok=True, worker_id="w")

    async def Generate(self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        self.num_calls += 1
        yield serving_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1])


class Server:
    """A grpc.aio server on its own event loop thread, as a worker runs one."""

    def __init__(self, auth: ClusterAuth) -> None:
        from worker.event_loop_thread import EventLoopThread

        self.worker = CountingWorker()
        self.aio = EventLoopThread("test-grpc")

        async def make() -> grpc.aio.Server:
            server = grpc.aio.server(interceptors=server_interceptors(auth))
            serving_pb2_grpc.add_WorkerServicer_to_server(self.worker, server)
            return server

        self.server = self.aio.run(make())
        port = add_port(self.server, "127.0.0.1:0", auth)
        assert port
        self.endpoint = f"127.0.0.1:{port}"
        self.aio.run(self.server.start())

    def stop(self) -> None:
        self.aio.run(self.server.stop(0))
        self.aio.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = Server(ClusterAuth(secret=SECRET))
    yield server
    server.stop()


def test_accepts_compares_the_secret() -> None:
    auth = ClusterAuth(secret=SECRET)
    assert auth.accepts([(METADATA_KEY, SECRET)])
    assert auth.accepts([("other", "x"), (METADATA_KEY, SECRET.encode())])
    assert not auth.accepts([(METADATA_KEY, SECRET + "x")])
    assert not auth.accepts([(METADATA_KEY, "")])
    assert not auth.accepts([("authorization", f"Bearer {SECRET}")])
    assert not auth.accepts(None)
    assert ClusterAuth().accepts(None)  # no secret: an open link
    assert SECRET not in repr(auth)
    with pytest.raises(ValueError):
        ClusterAuth(secret="has space")
    with pytest.raises(ValueError):
        ClusterAuth(tls_cert_path="c.pem")  # mutual TLS needs cert, key and CA


@pytest.mark.parametrize("auth", [ClusterAuth(), ClusterAuth(secret="wrong-secret")], ids=["none", "wrong"])
def test_calls_without_the_secret_are_refused_before_the_handler(server: Server, auth: ClusterAuth) -> None:
    before = server.worker.num_calls
    with sync_channel(server.endpoint, auth) as channel:
        stub = serving_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as unary:
            stub.Health(serving_pb2.HealthRequest(), timeout=10)
        assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as stream:
            list(stub.Generate(serving_pb2.GenerateRequest(request_id="r"), timeout=10))
        assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.worker.num_calls == before  # no handler ran


def test_sync_and_aio_channels_carry_the_secret(server: Server) -> None:
    auth = ClusterAuth(secret=SECRET)
    with sync_channel(server.endpoint, auth) as channel:
        stub = serving_pb2_grpc.WorkerStub(channel)
        assert stub.Health(serving_pb2.HealthRequest(), timeout=10).ok
        assert [m.token_ids[0] for m in stub.Generate(serving_pb2.GenerateRequest(request_id="r"), timeout=10)] == [1]

    async def aio_calls() -> tuple[bool, list[int]]:
        async with aio_channel(server.endpoint, auth) as channel:
            stub = serving_pb2_grpc.WorkerStub(channel)
            health = await stub.Health(serving_pb2.HealthRequest(), timeout=10)
            call = stub.Generate(serving_pb2.GenerateRequest(request_id="r"), timeout=10)
            tokens = [m.token_ids[0] async for m in call]
            return health.ok, tokens

    assert asyncio.run(aio_calls()) == (True, [1])


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _tls(certs: Certs, *, secret: str = SECRET, ca: Path | None = None, client: bool = False) -> ClusterAuth:
    cert, key = (certs.client_cert, certs.client_key) if client else (certs.server_cert, certs.server_key)
    return ClusterAuth(secret=secret, tls_cert_path=str(cert), tls_key_path=str(key), tls_ca_path=str(ca or certs.ca))


def test_mutual_tls(certs: Certs) -> None:
    server = Server(_tls(certs))
    try:
        with sync_channel(server.endpoint, _tls(certs, client=True)) as channel:
            assert serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=10).ok
        # plaintext, a client trusting another CA, a certificate from another CA: no connection at all
        for auth in (ClusterAuth(secret=SECRET), _tls(certs, client=True, ca=certs.other_ca)):
            with sync_channel(server.endpoint, auth) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # TLS right, secret wrong: still refused by the interceptor
        with sync_channel(server.endpoint, _tls(certs, client=True, secret="wrong")) as channel:
            with pytest.raises(grpc.RpcError) as wrong:
                serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=10)
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert server.worker.num_calls == 1
    finally:
        server.stop()
