"""The ipc transport's doorbell (kv_transfer/ipc_doorbell.py): the control call of a sender's later handoffs to a
receiver over a Unix socket instead of gRPC, with the same outcomes. On CPU (memfd buffers), real gRPC servers:

- the first handoff goes over gRPC and its ack names the doorbell; the next ones ring it; every byte lands;
- a sender made without it (bench/handoff_cost.py's baseline) calls gRPC every time;
- a doorbell call outlasting the sender's deadline raises its timeout in time, the receiver fails the handoff
  instead of committing it, and the next handoff gets through (over gRPC, then the doorbell again);
- a receiver whose doorbell was replaced (a restart) is reached over gRPC, then through its new doorbell;
- a connection from another user's process is refused without a word; a malformed frame drops the connection.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from kv_transfer import ipc_doorbell, ipc_transport
from kv_transfer.ipc_doorbell import DoorbellClient, DoorbellServer
from kv_transfer.layout import KVTransferError
from kv_transfer.registry import make_sender
from protos import kv_transfer_pb2
from tests.kv_transfer.test_transport_conformance import SLACK_S, SMALL, SMOLLM2
from tests.kv_transfer.transfer_peer import PatternSource, RecordingSink, make_handoff, serve_receiver


@pytest.fixture
def ipc_pair():  # noqa: ANN201
    """(sink, endpoint, receiver, sender) over a real gRPC server; all closed after."""
    made = []

    def make(layout=SMOLLM2, **sink_args):  # noqa: ANN001, ANN003, ANN202
        sink = RecordingSink(layout, num_cache_blocks=64, **sink_args)
        server, endpoint, receiver = serve_receiver("ipc", sink)
        sender = make_sender("ipc", worker_id="prefill-0", device=torch.device("cpu"))
        made.append((server, receiver, sender, sink))
        return sink, endpoint, receiver, sender

    yield make
    for server, receiver, sender, sink in made:
        sender.close()
        receiver.close()
        server.stop(grace=None)
        sink.assert_each_settled_once()


def _send(sender, endpoint: str, seed: int, layout=SMOLLM2, num_tokens: int = 16 * 3 + 5,  # noqa: ANN001
          timeout_s: float = 30.0):  # noqa: ANN202
    handoff = make_handoff(layout, num_tokens)
    source = PatternSource(layout, handoff.num_blocks, seed=seed)
    result = sender.send(handoff, source, endpoint=endpoint, timeout_s=timeout_s)
    return result, source


def _control(result) -> str:  # noqa: ANN001
    """How the handoff's control call went: "rpc" (gRPC) or "ring" (the doorbell)."""
    [how] = [stage for stage in ("rpc", "ring") if stage in result.stages_s]
    return how


def test_later_handoffs_ring_the_receivers_doorbell(ipc_pair) -> None:  # noqa: ANN001
    sink, endpoint, receiver, sender = ipc_pair()
    controls = []
    for seed in range(3):
        result, source = _send(sender, endpoint, seed)
        controls.append(_control(result))
        assert torch.equal(sink.destinations[-1].blocks(), source.blocks)
    assert controls == ["rpc", "ring", "ring"]
    assert sender._pairs[endpoint].doorbell.name == receiver._doorbell.name
    assert [d.outcome for d in sink.destinations] == ["committed"] * 3


def test_a_sender_without_the_doorbell_calls_grpc_every_time(ipc_pair) -> None:  # noqa: ANN001
    sink, endpoint, _, _ = ipc_pair()
    sender = ipc_transport.Sender(worker_id="prefill-1", device=torch.device("cpu"), doorbell=False)
    try:
        assert [_control(_send(sender, endpoint, seed)[0]) for seed in range(3)] == ["rpc"] * 3
    finally:
        sender.close()


def test_a_doorbell_call_past_the_deadline_times_out_and_the_receiver_fails_it(ipc_pair) -> None:  # noqa: ANN001
    sink, endpoint, _, sender = ipc_pair(layout=SMALL)
    assert _control(_send(sender, endpoint, 0, layout=SMALL, num_tokens=4 * 6)[0]) == "rpc"
    committed = sink.num_used  # the first handoff's blocks
    sink.write_delay_s = 0.3  # 6 blocks: ~1.8 s of copying against a 0.8 s deadline
    start_s = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out"):
        _send(sender, endpoint, 1, layout=SMALL, num_tokens=4 * 6, timeout_s=0.8)
    assert time.monotonic() - start_s < 0.8 + SLACK_S
    assert sender._pairs[endpoint].doorbell is None  # forgotten
    assert sink.destinations[-1].settled.wait(10), "the late handoff neither committed nor failed"
    assert sink.destinations[-1].outcome == "failed" and sink.num_used == committed  # its reservation freed
    sink.write_delay_s = 0.0
    controls = [_control(_send(sender, endpoint, seed, layout=SMALL, num_tokens=4 * 6)[0]) for seed in (2, 3)]
    assert controls == ["rpc", "ring"]
    assert [d.outcome for d in sink.destinations] == ["committed", "failed", "committed", "committed"]


def test_a_receiver_with_a_new_doorbell_is_reached_over_grpc_then_through_it(ipc_pair) -> None:  # noqa: ANN001
    sink, endpoint, receiver, sender = ipc_pair()
    assert [_control(_send(sender, endpoint, seed)[0]) for seed in (0, 1)] == ["rpc", "ring"]
    old = receiver._doorbell
    receiver._doorbell = DoorbellServer(receiver._ring)  # what a restarted receiver process would have
    old.close()
    controls = []
    for seed in (2, 3):
        result, source = _send(sender, endpoint, seed)
        controls.append(_control(result))
        assert torch.equal(sink.destinations[-1].blocks(), source.blocks)
    assert controls == ["rpc", "ring"]
    assert sender._pairs[endpoint].doorbell.name == receiver._doorbell.name != old.name


def test_another_users_process_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    server = DoorbellServer(lambda request, deadline_s: calls.append(request) or kv_transfer_pb2.KVTransferAck())
    try:
        monkeypatch.setattr(ipc_doorbell.os, "getuid", lambda: os.geteuid() + 1)  # the server's user is another
        client = DoorbellClient(server.name)
        with pytest.raises(ConnectionError):
            client.call(kv_transfer_pb2.KVIpcHandoff(), 5.0)
        monkeypatch.undo()
        assert DoorbellClient(server.name).call(kv_transfer_pb2.KVIpcHandoff(), 5.0).ok is False
        assert len(calls) == 1
    finally:
        server.close()


def test_a_malformed_frame_drops_the_connection_and_the_server_goes_on() -> None:
    server = DoorbellServer(lambda request, deadline_s: kv_transfer_pb2.KVTransferAck(ok=True))
    try:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(5.0)
        raw.connect(b"\0" + server.name.encode())
        raw.sendall((ipc_doorbell.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))  # longer than any frame may be
        assert raw.recv(1) == b""  # closed
        raw.close()
        assert DoorbellClient(server.name).call(kv_transfer_pb2.KVIpcHandoff(), 5.0).ok
    finally:
        server.close()
