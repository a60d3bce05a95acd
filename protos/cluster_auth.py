"""How every gRPC link inside the cluster is authenticated: a cluster secret on every call, optional mutual TLS.

No torch: the router, the controller, the workers and the KV transports all import it.

    caller (router, decode worker, KV sender, health checks)        server (every worker's grpc.aio server)
    ──────                                                          ──────
    channel = aio_channel(endpoint, auth) / sync_channel(...)       server = grpc.aio.server(
      every call carries metadata                                       interceptors=server_interceptors(auth))
      x-splitserve-cluster-secret: <secret>  ─────────────────────▶ SecretInterceptor: compare in constant time;
                                                                      missing or wrong → UNAUTHENTICATED, and the
                                                                      method's handler never runs (no work, no
                                                                      request bytes parsed, no block allocated)
    TLS (optional, both ends): the server presents its certificate and requires the client's, both signed by
    `tls_ca_path` (add_port / the channel factories).

`ClusterAuth()` with no secret and no TLS is an open link: what a worker started by hand on a laptop gets.
`splitserve serve` always sets a secret (a random one per cluster unless `--cluster-secret` or
SPLITSERVE_CLUSTER_SECRET names one). Over plaintext the secret travels in clear like any bearer token: across
networks you do not trust, add TLS. The secret is never logged (the dataclass' repr hides it).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

CLUSTER_SECRET_ENV = "SPLITSERVE_CLUSTER_SECRET"
METADATA_KEY = "x-splitserve-cluster-secret"  # gRPC metadata keys are lowercase
UNAUTHENTICATED_MESSAGE = "missing or wrong cluster secret"


# A peer that stops answering (its host cut off, its process stopped) fails the calls in flight on it within about
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS (UNAVAILABLE), instead of leaving them waiting on TCP for minutes: the
# callers' channels ping every KEEPALIVE_TIME_MS while a call is open, with or without data in between, and give up
# on a ping unanswered for KEEPALIVE_TIMEOUT_MS. HTTP/2 pings are answered by gRPC's own threads, not by a busy
# engine or event loop: a busy worker is not taken for a dead one. The servers accept pings that often.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 10_000
CALLER_KEEPALIVE = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a stream's silence (a long prefill)
)
SERVER_KEEPALIVE = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a caller for its pings
)


def generate_secret() -> str:
    """A fresh random cluster secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, kw_only=True)
class ClusterAuth:
    """What one process needs to call and to serve cluster-internal gRPC. Frozen, no I/O (`tls_credentials`
    reads the files, at channel / port creation).

    `secret`: "" for none (calls carry nothing, servers check nothing). TLS is on when `tls_cert_path` and
    `tls_key_path` are set: this process' certificate, presented as a server and as a client; `tls_ca_path`, the CA
    that signs every peer's certificate (required with TLS: the links are mutual)."""

    secret: str = field(default="", repr=False)
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_ca_path: str | None = None

    def __post_init__(self) -> None:
        tls_paths = (self.tls_cert_path, self.tls_key_path, self.tls_ca_path)
        if any(tls_paths) and not all(tls_paths):
            raise ValueError("gRPC TLS needs all of --grpc-tls-cert, --grpc-tls-key and --grpc-tls-ca")
        if self.secret != self.secret.strip() or any(ord(c) < 0x21 or ord(c) > 0x7E for c in self.secret):
            raise ValueError("the cluster secret must be printable ASCII without spaces (it travels as gRPC metadata)")

    @property
    def tls(self) -> bool:
        return self.tls_cert_path is not None

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every outgoing call carries."""
        return ((METADATA_KEY, self.secret),) if self.secret else ()

    def accepts(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether a call's metadata carries this secret (always, without one). Compared in constant time."""
        if not self.secret:
            return True
        given = next((value for key, value in metadata or () if key == METADATA_KEY), None)
        if given is None:
            return False
        given_bytes = given if isinstance(given, bytes) else given.encode()
        return hmac.compare_digest(given_bytes, self.secret.encode())

    def tls_files(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA) as PEM bytes, read now."""
        assert self.tls_cert_path and self.tls_key_path and self.tls_ca_path
        return (Path(self.tls_cert_path).read_bytes(), Path(self.tls_key_path).read_bytes(),
                Path(self.tls_ca_path).read_bytes())


OPEN = ClusterAuth()


# ── servers ──────────────────────────────────────────────────────────────────────────────────────────────────


async def _deny_unary(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_stream(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call before reading any request message (no
    deserializer: the bytes are never parsed)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny_stream)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny_unary)
    return grpc.unary_unary_rpc_method_handler(_deny_unary)


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that does not carry the cluster secret."""

    def __init__(self, auth: ClusterAuth) -> None:
        self._auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)  # a lookup: the method does not run
        if handler is None or self._auth.accepts(handler_call_details.invocation_metadata):
            return handler
        return _denying_handler(handler)


def server_interceptors(auth: ClusterAuth) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a grpc.aio server of the cluster is built with."""
    return [SecretInterceptor(auth)] if auth.secret else []


def add_port(server: grpc.aio.Server, address: str, auth: ClusterAuth) -> int:
    """Bind `address` ("host:port") with TLS that requires a client certificate when `auth.tls`, else plaintext.
    Returns the bound port (0 when it could not bind)."""
    if not auth.tls:
        return server.add_insecure_port(address)
    cert, key, ca = auth.tls_files()
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return server.add_secure_port(address, credentials)


# ── channels ─────────────────────────────────────────────────────────────────────────────────────────────────


def _client_credentials(auth: ClusterAuth) -> grpc.ChannelCredentials:
    cert, key, ca = auth.tls_files()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _with_secret(details: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
    """`details` (an aio ClientCallDetails) with the secret added to its metadata."""
    merged = grpc.aio.Metadata(*(details.metadata or ()), *metadata)
    return details._replace(metadata=merged)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_secret(details, self._metadata), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_secret(details, self._metadata), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_secret(details, self._metadata), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_secret(details, self._metadata), request_iterator)


def aio_channel(endpoint: str, auth: ClusterAuth, *, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to a cluster peer whose every call carries the secret (TLS when configured). Make it
    on the event loop that will use it."""
    metadata = auth.call_metadata()
    interceptors = ([_AioUnaryUnary(metadata), _AioUnaryStream(metadata), _AioStreamUnary(metadata),
                     _AioStreamStream(metadata)] if metadata else None)
    if auth.tls:
        return grpc.aio.secure_channel(endpoint, _client_credentials(auth), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)


class _SyncSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the secret to every call of a sync channel (grpc.intercept_channel takes one object for all shapes)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return _SyncCallDetails(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                                details.credentials, getattr(details, "wait_for_ready", None),
                                getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


class _SyncCallDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: Any, credentials: Any,
                 wait_for_ready: bool | None, compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def sync_channel(endpoint: str, auth: ClusterAuth, *, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to a cluster peer whose every call carries the secret (TLS when configured)."""
    if auth.tls:
        channel = grpc.secure_channel(endpoint, _client_credentials(auth), options=options)
    else:
        channel = grpc.insecure_channel(endpoint, options=options)
    metadata = auth.call_metadata()
    return grpc.intercept_channel(channel, _SyncSecret(metadata)) if metadata else channel


# ── flags ────────────────────────────────────────────────────────────────────────────────────────────────────


def add_cluster_auth_args(parser: Any) -> None:
    """--cluster-secret and --grpc-tls-{cert,key,ca} on an argparse parser (serve and the worker entry points)."""
    parser.add_argument("--cluster-secret", default=None,
                        help=f"secret every cluster-internal gRPC call carries (default: ${CLUSTER_SECRET_ENV}; "
                             "prefer the variable: a flag shows in ps)")
    parser.add_argument("--grpc-tls-cert", default=None, help="PEM certificate of this process' gRPC links (mTLS)")
    parser.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    parser.add_argument("--grpc-tls-ca", default=None, help="PEM CA that signs every cluster peer's certificate")


def cluster_auth_from_args(args: Any, environ: Any, *, generate: bool = False) -> ClusterAuth:
    """The ClusterAuth the flags and the environment name. `generate`: a random secret when neither names one
    (`serve`, which hands it to the workers it starts)."""
    secret = args.cluster_secret or environ.get(CLUSTER_SECRET_ENV) or ""
    if not secret and generate:
        secret = generate_secret()
    return ClusterAuth(secret=secret, tls_cert_path=args.grpc_tls_cert, tls_key_path=args.grpc_tls_key,
                       tls_ca_path=args.grpc_tls_ca)
