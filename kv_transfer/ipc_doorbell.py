"""The ipc transport's control call without gRPC: a doorbell, a Unix socket between the two worker processes.

The ipc transport's bytes never leave shared memory, so its one control call per handoff is most of what a handoff
costs (~1.8 ms of a 3.8 ms handoff on an H200 host: the gRPC call reaching the handler through the aio server's
thread hand-offs, and its ack coming back; docs/benchmarks.md). A doorbell carries the same KVIpcHandoff and
KVTransferAck over a Unix socket with a thread on each end instead:

    receiver (ipc Receiver)                                   sender (ipc Sender), per receiver endpoint
    ────────                                                  ──────
    a listening socket in the abstract namespace,            the first handoff calls IpcTransfer over gRPC; its
    named at random per receiver ──── in each gRPC ack ────▶ ack names the doorbell
    a thread per connection: read a request,                 later handoffs: connect once, then per handoff
    handle it as IpcTransfer does, write the ack  ◀────────▶  write [time left, KVIpcHandoff], read the KVTransferAck

Frames: a 4-byte big-endian length, then the bytes; a request's bytes are an 8-byte float (the sender's time left,
seconds) then the serialized KVIpcHandoff; an ack's are the serialized KVTransferAck.

Who may ring: an abstract socket lives in the network namespace, so only processes on this host's namespace can
reach it, and the receiver accepts a connection only from a process of its own user (SO_PEERCRED): the same
processes that could map the staging buffer, which the receiver opens through /proc/<pid>/fd, or read either
worker's memory. The cluster secret and TLS guard the gRPC links between hosts; the doorbell never leaves one.

Failures: a doorbell the sender cannot reach (the receiver restarted, or is in another namespace) is forgotten and
that handoff goes over gRPC, which names the new doorbell. A connection that breaks or times out once the request
is written fails the handoff as an unreachable receiver's gRPC call does (KVTransferError / KVTransferTimeout) and
is forgotten; the receiver, as under gRPC, fails the handoff if the sender's time ran out before its copy ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from protos import kv_transfer_pb2

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
_TIME_LEFT = struct.Struct("!d")
MAX_FRAME_BYTES = 64 << 20  # a descriptor of a very long prompt, as the gRPC link's message limit
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# (request, its deadline on this host's monotonic clock) -> the ack
Handler = Callable[[kv_transfer_pb2.KVIpcHandoff, float], kv_transfer_pb2.KVTransferAck]


class DoorbellClosed(ConnectionError):
    """The other end closed the connection."""


def _read_exact(sock: socket.socket, num_bytes: int) -> bytes:
    chunks = []
    while num_bytes:
        chunk = sock.recv(num_bytes)
        if not chunk:
            raise DoorbellClosed("the doorbell's other end closed the connection")
        chunks.append(chunk)
        num_bytes -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> bytes:
    (length,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"a doorbell frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return _read_exact(sock, length)


def write_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def _address(name: str) -> bytes:
    return b"\0" + name.encode()


# ── receiver ─────────────────────────────────────────────────────────────────────────────────────────────────


class DoorbellServer:
    """A receiver's doorbell: `handler(request, deadline_s)` answers each request, on the connection's thread."""

    def __init__(self, handler: Handler) -> None:
        self.name = f"splitserve-kv-ipc-{os.getpid()}-{secrets.token_hex(8)}"
        self._handler = handler
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_address(self.name))
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ipc-kv-doorbell", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every connection (a handler running finishes; its ack goes nowhere)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections, self._connections = list(self._connections), set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not _same_user(conn):
                logger.warning("ipc doorbell %s: refused a connection from another user's process", self.name)
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="ipc-kv-doorbell-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                frame = read_frame(conn)
                (time_left_s,) = _TIME_LEFT.unpack_from(frame)
                request = kv_transfer_pb2.KVIpcHandoff.FromString(frame[_TIME_LEFT.size:])
                ack = self._handler(request, time.monotonic() + time_left_s)
                write_frame(conn, ack.SerializeToString())
        except (OSError, ValueError) as exc:  # the sender went away, or a malformed frame: drop the connection
            if not isinstance(exc, DoorbellClosed) and not self._closed:
                logger.debug("ipc doorbell %s: connection dropped: %r", self.name, exc)
        except Exception:  # noqa: BLE001 - a handler bug must not leave the thread dead and the sender waiting
            logger.exception("ipc doorbell %s: handler failed", self.name)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()


def _same_user(conn: socket.socket) -> bool:
    try:
        _, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return False
    return uid == os.getuid()


# ── sender ───────────────────────────────────────────────────────────────────────────────────────────────────


class DoorbellUnreachable(ConnectionError):
    """Nothing was sent: the handoff may go over gRPC instead."""


class DoorbellClient:
    """The sender's connection to one receiver's doorbell; one call at a time (the ipc pair's lock)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sock: socket.socket | None = None

    def call(self, request: kv_transfer_pb2.KVIpcHandoff, time_left_s: float) -> kv_transfer_pb2.KVTransferAck:
        """Ring with `request`; the receiver's ack. DoorbellUnreachable when the receiver could not have read the
        request (no connection, or its end gone); TimeoutError after `time_left_s`, ConnectionError (or a protobuf
        DecodeError) if the connection broke while waiting for the ack. The connection is closed on any error."""
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(time_left_s, 1e-3))
                sock.connect(_address(self.name))
            except OSError as exc:
                sock.close()
                raise DoorbellUnreachable(f"ipc doorbell {self.name}: {exc}") from exc
            self._sock = sock
        sock = self._sock
        try:
            sock.settimeout(max(time_left_s, 1e-3))
            try:
                write_frame(sock, _TIME_LEFT.pack(time_left_s) + request.SerializeToString())
            except OSError as exc:  # the receiver's end is gone (restarted, closed): it read no whole request
                raise DoorbellUnreachable(f"ipc doorbell {self.name}: {exc}") from exc
            return kv_transfer_pb2.KVTransferAck.FromString(read_frame(sock))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
