"""The gRPC link between a KV sender and its receiver's worker server, shared by every transport that talks gRPC:
the grpc transport for the whole handoff, the ipc and torch transports for their control messages.

    ChannelSender                                                 SettlingReceiver (on the worker's gRPC server)
      └─ ChannelCache: a channel per receiver endpoint ──call──▶  open(handoff): layout checked, then the sink
         (the cluster secret, CHANNEL_OPTIONS)                    ... the transport moves and verifies the blocks ...
      a failed call ──▶ rpc_error: KVTransferError  ◀──ack────── error_ack(exc): ok=False, error, error_kind
      a negative ack ──▶ ack_error: that same KVTransferError subclass

- `ChannelSender` holds what every gRPC-linked sender is made of: its worker id, device, test fault and channels.
  `close()` closes the channels; a subclass that holds more releases that, then calls it.
- `SettlingReceiver` keeps every destination it opened until its handler `forget`s it; `close()` refuses new
  handoffs and fails those still open. Each destination is settled (committed or failed) exactly once.
- A refusal means the same on both ends whatever the transport: the ack carries its `error_kind`, and the sender
  raises the receiver's KVTransferError subclass from it.
"""

from __future__ import annotations

import dataclasses
import threading

import grpc
import torch

from kv_transfer.base import KVReceiver, KVSender, KVSink, SettleOnce, TransferFault, check_receivable
from kv_transfer.grpc_wire import encode_message
from kv_transfer.layout import KVHandoff, KVTransferError, KVTransferTimeout, error_from_kind, error_kind
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.cluster_auth import OPEN, ClusterAuth, sync_channel

MAX_MESSAGE_BYTES = 64 << 20  # raised on our channels all the same, for the descriptor of a very long prompt
# HTTP/2 frames up to 4 MiB instead of 16 KiB: a 0.7 MiB block goes in one DATA frame, not 45. The setting is the
# largest frame an endpoint accepts, so it matters on the receiving server (whose options these also are).
MAX_FRAME_BYTES = 4 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.max_frame_size", MAX_FRAME_BYTES),
)
SERVICE = "splitserve.kv.v1.KVReceiver"  # protos/kv_transfer.proto's package and service
TRANSFER_METHOD = f"/{SERVICE}/Transfer"


class ChannelCache:
    """One channel per receiver endpoint, made on first use, carrying the cluster secret; thread-safe."""

    def __init__(self, auth: ClusterAuth = OPEN) -> None:
        self._auth = auth
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = sync_channel(endpoint, self._auth, options=CHANNEL_OPTIONS)
                self._channels[endpoint] = channel
        return channel

    def stub(self, endpoint: str) -> kv_transfer_pb2_grpc.KVReceiverStub:
        return kv_transfer_pb2_grpc.KVReceiverStub(self.channel(endpoint))

    def transfer(self, endpoint: str) -> grpc.StreamUnaryMultiCallable:
        """KVReceiver.Transfer on `endpoint`, with the hand-made chunk encoding (kv_transfer.grpc_wire)."""
        return self.channel(endpoint).stream_unary(
            TRANSFER_METHOD,
            request_serializer=encode_message,
            response_deserializer=kv_transfer_pb2.KVTransferAck.FromString,
        )

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint's channel after it proved unreachable, so that the next send dials afresh instead of
        waiting out the old channel's reconnect backoff (a restarted worker reuses its address). Calls still in
        flight on it keep it alive until they end."""
        with self._lock:
            self._channels.pop(endpoint, None)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


def rpc_error(exc: grpc.RpcError, *, what: str, endpoint: str, timeout_s: float) -> KVTransferError:
    """A KVTransferError saying why a call to the receiver at `endpoint` failed."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s waiting for the receiver at {endpoint}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return KVTransferError(f"{what}: receiver at {endpoint} unavailable (dead or unreachable): {details}")
    if code == grpc.StatusCode.CANCELLED:
        return KVTransferError(f"{what}: call to the receiver at {endpoint} was cancelled: {details}")
    name = code.name if code is not None else "unknown status"
    return KVTransferError(f"{what}: receiver at {endpoint} answered {name}: {details}")


def refusal(exc: Exception) -> KVTransferError:
    """The receiver-side view of an exception: KVTransferError subclasses as they are, anything else wrapped."""
    if isinstance(exc, KVTransferError):
        return exc
    return KVTransferError(f"{type(exc).__name__}: {exc}")


def error_ack(exc: Exception) -> kv_transfer_pb2.KVTransferAck:
    err = refusal(exc)
    return kv_transfer_pb2.KVTransferAck(ok=False, error=str(err), error_kind=error_kind(err))


def ack_error(ack: kv_transfer_pb2.KVTransferAck | kv_transfer_pb2.KVOpenAck, *, endpoint: str) -> KVTransferError:
    """The exception a sender raises for a receiver's negative ack, of the subclass the receiver reported."""
    return error_from_kind(ack.error_kind, f"receiver at {endpoint} refused: {ack.error}")


def with_source(handoff: KVHandoff, *, worker_id: str, transport: str) -> KVHandoff:
    """The handoff as it goes on the wire: the sender's identity and transport filled in where the caller left
    them empty."""
    return dataclasses.replace(
        handoff,
        source_worker_id=handoff.source_worker_id or worker_id,
        transport=handoff.transport or transport,
    )


class ChannelSender(KVSender):
    """A sender that reaches its receivers over gRPC: its identity, its device, the test fault it injects, and one
    cached channel per receiver endpoint (`_channels`). Thread-safe as its channel cache is."""

    def __init__(self, *, worker_id: str, device: torch.device, fault: TransferFault | None = None,
                 auth: ClusterAuth = OPEN) -> None:
        self.worker_id = worker_id
        self.device = torch.device(device)
        self.fault = fault or TransferFault()
        self._channels = ChannelCache(auth)

    def close(self) -> None:
        self._channels.close()


class SettlingReceiver(KVReceiver):
    """A receiver that keeps every destination it opened until `forget`, so that `close` can fail the handoffs
    still in flight; each destination is settled (committed or failed) exactly once. Its handler threads call
    `open` when a handoff arrives and `forget` when they answered it."""

    def __init__(self, sink: KVSink) -> None:
        super().__init__(sink)
        self._lock = threading.Lock()
        self._open: set[SettleOnce] = set()
        self._closed = False

    def close(self) -> None:
        """Refuse new handoffs and fail the ones in flight (their handler threads then end the calls)."""
        with self._lock:
            self._closed = True
            dests, self._open = list(self._open), set()
        for dest in dests:
            dest.fail("KV receiver closed")

    def open(self, handoff: KVHandoff) -> SettleOnce:
        """Layout first (before any byte is accepted), then the sink, which may refuse."""
        check_receivable(self.sink, handoff)
        with self._lock:
            if self._closed:
                raise KVTransferError("KV receiver is closed")
        dest = SettleOnce(self.sink.open(handoff))
        with self._lock:
            closed = self._closed
            if not closed:
                self._open.add(dest)
        if closed:
            dest.fail("KV receiver closed")
            raise KVTransferError("KV receiver is closed")
        return dest

    def forget(self, dest: SettleOnce) -> None:
        with self._lock:
            self._open.discard(dest)
