"""The ipc transport beyond the conformance suite (tests/kv_transfer/test_transport_conformance.py, which runs it
as ipc-shm and, on a GPU, ipc-cuda): a sender in another process whose buffer the receiver maps as it grows and
as a one-off, a sender that exits and leaves nothing mapped, and a receiver whose copy outlasts the sender's
deadline."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from kv_transfer.ipc_transport import REAP_INTERVAL_S
from kv_transfer.layout import KVTransferError
from kv_transfer.registry import make_sender
from tests.kv_transfer.test_transport_conformance import (  # noqa: F401 - peers: a fixture
    SLACK_S,
    SMALL,
    SMOLLM2,
    TRANSPORTS,
    Case,
    _wait_settled,
    peers,
)
from tests.kv_transfer.transfer_peer import PatternSource, RecordingSink, make_handoff, serve_receiver

IPC_TRANSPORTS = [p for p in TRANSPORTS if p.values[0].transport == "ipc"]


@pytest.mark.parametrize("ipc_case", IPC_TRANSPORTS)
def test_ipc_maps_another_processs_buffer(ipc_case: Case, peers) -> None:  # noqa: F811 - the fixture
    """A sender process hands over a small handoff, a larger one (its buffer grows: the receiver maps the new one)
    and one over KEEP_BYTES (a one-off buffer, unmapped after): every byte lands, and the receiver keeps only the
    sender's current buffer mapped."""
    sink = RecordingSink(SMOLLM2, num_cache_blocks=64, device=ipc_case.sink_device)
    server, endpoint, receiver = serve_receiver(ipc_case.transport, sink)
    sizes = [16 * 2 + 1, 16 * 9 + 5, 16 * 40]
    try:
        peer = peers("sender", ipc_case, SMOLLM2, "--device", ipc_case.sender_device, "--endpoint", endpoint,
                     "--num-tokens", ",".join(map(str, sizes)), "--ipc-keep-bytes", str(16 * SMOLLM2.block_bytes))
        peer.expect("SENT", timeout_s=60)
        assert [d.outcome for d in sink.destinations] == ["committed"] * len(sizes)
        for seed, dest in enumerate(sink.destinations):
            expected = PatternSource(SMOLLM2, dest.handoff.num_blocks, seed=seed).blocks
            assert torch.equal(dest.blocks().cpu().view(torch.uint8), expected.view(torch.uint8))
        mapped = list(receiver._mapped)  # the second handoff's buffer: the first's was replaced, the one-off dropped
        assert len(mapped) == 1 and mapped[0].startswith(f"{peer.proc.pid}-"), mapped
    finally:
        receiver.close()
        server.stop(grace=None)
    sink.assert_each_settled_once()


def memfd_inodes(pid: int) -> set[int]:
    """Inodes of the ipc staging buffers (memfds) process `pid` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {int(line.split()[4]) for line in maps if "/memfd:splitserve-kv" in line}


@pytest.mark.parametrize("ipc_case", IPC_TRANSPORTS)
def test_a_sender_that_exits_leaves_nothing_mapped(ipc_case: Case, peers) -> None:  # noqa: F811 - the fixture
    """The receiver keeps a sender's buffer mapped for its next handoff; once that sender process is killed, the
    receiver unmaps it within REAP_INTERVAL_S (a mapping would hold the dead process's memory for good)."""
    sink = RecordingSink(SMOLLM2, num_cache_blocks=64, device=ipc_case.sink_device)
    server, endpoint, receiver = serve_receiver(ipc_case.transport, sink)
    try:
        peer = peers("sender", ipc_case, SMOLLM2, "--device", ipc_case.sender_device, "--endpoint", endpoint,
                     "--num-tokens", str(16 * 2 + 1))
        peer.expect("SENT", timeout_s=60)
        assert [d.outcome for d in sink.destinations] == ["committed"]
        [mapped] = receiver._mapped
        assert mapped.startswith(f"{peer.proc.pid}-")
        on_cpu = ipc_case.sender_device == "cpu"
        buffers = memfd_inodes(peer.proc.pid) if on_cpu else set()
        assert not on_cpu or (len(buffers) == 1 and buffers <= memfd_inodes(os.getpid()))  # shared with us
        peer.signal(signal.SIGKILL)
        peer.proc.wait(timeout=10)
        deadline_s = time.monotonic() + REAP_INTERVAL_S + SLACK_S
        while receiver._mapped or buffers & memfd_inodes(os.getpid()):
            assert time.monotonic() < deadline_s, (list(receiver._mapped), buffers & memfd_inodes(os.getpid()))
            time.sleep(0.05)
    finally:
        receiver.close()
        server.stop(grace=None)
    sink.assert_each_settled_once()


@pytest.mark.parametrize("ipc_case", IPC_TRANSPORTS)
def test_ipc_receiver_past_the_senders_deadline_fails_instead_of_committing(ipc_case: Case) -> None:
    """A receiver whose copy outlasts the sender's deadline (a slow sink) fails the handoff rather than commit
    blocks the sender has given up on; the sender raises by its timeout; every block comes back."""
    sink = RecordingSink(SMALL, device=ipc_case.sink_device, write_delay_s=0.3)
    server, endpoint, receiver = serve_receiver(ipc_case.transport, sink)
    sender = make_sender(ipc_case.transport, worker_id="prefill-0", device=torch.device(ipc_case.sender_device))
    handoff = make_handoff(SMALL, 4 * 6)
    try:
        start_s = time.monotonic()
        with pytest.raises(KVTransferError, match="timed out"):
            sender.send(handoff, PatternSource(SMALL, handoff.num_blocks, device=ipc_case.sender_device),
                        endpoint=endpoint, timeout_s=0.8)
        assert time.monotonic() - start_s < 0.8 + SLACK_S
        assert _wait_settled(sink, 10) < 10
        assert sink.only().outcome == "failed" and sink.num_used == 0
    finally:
        sender.close()
        receiver.close()
        server.stop(grace=None)
    sink.assert_each_settled_once()


@pytest.mark.parametrize("ipc_case", IPC_TRANSPORTS)
def test_a_second_handoff_stages_in_the_same_buffer(ipc_case: Case) -> None:
    """The pair's staging buffer is made once, for the first handoff, and serves the next ones of that size or less;
    the receiver maps it once."""
    sink = RecordingSink(SMOLLM2, num_cache_blocks=64, device=ipc_case.sink_device)
    server, endpoint, receiver = serve_receiver(ipc_case.transport, sink)
    sender = make_sender(ipc_case.transport, worker_id="prefill-0", device=torch.device(ipc_case.sender_device))
    try:
        buffers = []
        for seed, num_tokens in enumerate((16 * 6, 16 * 6, 16 * 2 + 1)):
            handoff = make_handoff(SMOLLM2, num_tokens)
            source = PatternSource(SMOLLM2, handoff.num_blocks, seed=seed, device=ipc_case.sender_device)
            sender.send(handoff, source, endpoint=endpoint, timeout_s=30)
            assert torch.equal(sink.destinations[-1].blocks().cpu(), source.blocks.cpu())
            buffers.append(sender._pairs[endpoint].buffer)
        assert buffers[0] is buffers[1] is buffers[2]
        assert list(receiver._mapped) == [buffers[0].id]
    finally:
        sender.close()
        receiver.close()
        server.stop(grace=None)
    sink.assert_each_settled_once()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_on_a_gpu_a_scattering_destination_is_written_before_the_one_check(corrupt: bool) -> None:
    """A destination that scatters (the decode worker's reservation) gets all blocks in one write before the
    receiver's one sync reads the digests back; a corrupted block then fails the handoff, which frees every block
    unread (RecordingDestination's no-scatter path, verified before writing, is the conformance suite's)."""
    from kv_transfer.base import TransferFault
    from kv_transfer.layout import KVChecksumError

    layout = dataclasses.replace(SMOLLM2, dtype="bfloat16")
    sink = RecordingSink(layout, num_cache_blocks=64, device="cuda:0", scatters=True)
    server, endpoint, receiver = serve_receiver("ipc", sink)
    sender = make_sender("ipc", worker_id="prefill-0", device=torch.device("cuda:0"))
    sender.fault = TransferFault(corrupt_block=3) if corrupt else TransferFault()
    handoff = make_handoff(layout, 1000)
    source = PatternSource(layout, handoff.num_blocks, device="cuda:0")
    try:
        if corrupt:
            with pytest.raises(KVChecksumError, match="block 3 failed its checksum"):
                sender.send(handoff, source, endpoint=endpoint, timeout_s=30)
        else:
            sender.send(handoff, source, endpoint=endpoint, timeout_s=30)
    finally:
        sender.close()
        receiver.close()
        server.stop(grace=None)
    dest = sink.only()
    assert dest.scatters == 1
    if corrupt:
        assert dest.outcome == "failed" and sink.num_used == 0
    else:
        assert dest.outcome == "committed"
        assert torch.equal(dest.blocks().view(torch.uint8), source.blocks.view(torch.uint8))
    sink.assert_each_settled_once()
