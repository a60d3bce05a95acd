"""The one suite every KV transport passes: in-process, gRPC, torch.distributed (gloo here; NCCL with 2 GPUs), and
shared memory on one host (ipc: a memfd here; CUDA IPC on a GPU).

Each test runs a real gRPC server with the transport's receiver attached and a recording sink over a fake paged
cache. The dead-peer cases run the other end in a subprocess (tests/kv_transfer/transfer_peer.py) and kill or
freeze it mid-transfer. After every test, each destination the sink opened has ended in exactly one commit or
one fail.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _pytest.mark import ParameterSet

from engine.kv_cache_dtype import kv_block_bytes
from engine.loader.dummy_weights import dummy_model_config
from kv_transfer.base import KVSender, TransferFault
from kv_transfer.layout import KVChecksumError, KVLayout, KVLayoutMismatch, KVTransferError, KVTransferTimeout
from kv_transfer.registry import make_sender
from tests.kv_transfer.transfer_peer import (
    PatternSource,
    RecordingDestination,
    RecordingSink,
    format_layout,
    make_handoff,
    read_ahead_threads_gone,
    serve_receiver,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 3.0  # what "within the timeout" may overrun by: thread wake-ups on a busy 2-core machine

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")  # 1 KiB blocks
SMALL_BF16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")  # 720 KiB blocks
SMOLLM2_B32 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype="float32")  # 1.4 MiB
# Over the gRPC transport's 3 MiB chunk: a block sent as runs of whole layers, and one whose layers are each too big
SPLIT_BY_LAYERS = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=1100, dtype="float32")  # 4.3 MiB
SPLIT_BY_BYTES = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=1600, dtype="float32")  # 6.25 MiB
# --kv-cache-dtype int8: int8 values and a float32 scale per layer, K/V and KV head; one block = values ‖ scales
INT8 = dataclasses.replace(SMALL, kv_cache_dtype="int8")  # 256 + 32 bytes
INT8_SMOLLM2 = dataclasses.replace(SMOLLM2, kv_cache_dtype="int8")  # 180 KiB + 720 bytes: 0.251x of float32's
# --kv-cache-dtype fp8: e4m3 values, no scales; a block travels as its values' bytes
FP8 = dataclasses.replace(SMALL_BF16, kv_cache_dtype="fp8")  # 128 bytes
FP8_SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16",
                       kv_cache_dtype="fp8")  # 180 KiB: half of bfloat16's
INT8_SPLIT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=6200, dtype="float32",
                      kv_cache_dtype="int8")  # 6.1 MiB: over the gRPC chunk, split by bytes (the scales in the last)


@dataclass(frozen=True, kw_only=True)
class Case:
    transport: str
    sender_device: str = "cpu"
    sink_device: str = "cpu"


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _on_gpus(case: Case, case_id: str, needed: int, reason: str) -> ParameterSet:
    return pytest.param(case, id=case_id,
                        marks=[pytest.mark.gpu, pytest.mark.skipif(_num_gpus() < needed, reason=reason)])


TRANSPORTS = [
    pytest.param(Case(transport="inproc"), id="inproc"),
    pytest.param(Case(transport="grpc"), id="grpc"),
    pytest.param(Case(transport="torch"), id="torch-gloo"),
    pytest.param(Case(transport="ipc"), id="ipc-shm"),
    # KV resident on a GPU at both ends: inproc and ipc (CUDA IPC) copy device to device; gRPC stages through the
    # host.
    _on_gpus(Case(transport="inproc", sender_device="cuda:0", sink_device="cuda:0"), "inproc-cuda", 1,
             "needs a CUDA GPU"),
    _on_gpus(Case(transport="grpc", sender_device="cuda:0", sink_device="cuda:0"), "grpc-cuda", 1,
             "needs a CUDA GPU"),
    _on_gpus(Case(transport="ipc", sender_device="cuda:0", sink_device="cuda:0"), "ipc-cuda", 1,
             "needs a CUDA GPU"),
    _on_gpus(Case(transport="torch", sender_device="cuda:0", sink_device="cuda:1"), "torch-nccl", 2,
             "NCCL point-to-point needs 2 GPUs"),
]
# The dead-peer cases need a peer in another process; inproc has none by definition (its sender giving up is
# test_sender_stopping_mid_transfer_fails_the_destination).
DEAD_PEER_TRANSPORTS = [p for p in TRANSPORTS if p.values[0].transport != "inproc"]


@pytest.fixture(params=TRANSPORTS)
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


class Harness:
    """A started gRPC server with the case's receiver over a recording sink, and the senders made for it."""

    def __init__(self, case: Case, sink: RecordingSink) -> None:
        self.case = case
        self.sink = sink
        self.server, self.endpoint, self.receiver = serve_receiver(case.transport, sink)
        self.senders: list[KVSender] = []

    def sender(self, fault: TransferFault | None = None, worker_id: str = "prefill-0") -> KVSender:
        sender = make_sender(self.case.transport, worker_id=worker_id, device=torch.device(self.case.sender_device))
        if fault is not None:
            sender.fault = fault  # type: ignore[attr-defined]  # every transport's Sender takes a test fault
        self.senders.append(sender)
        return sender

    def source(self, num_blocks: int, *, layout: KVLayout | None = None, seed: int = 0) -> PatternSource:
        return PatternSource(layout or self.sink.layout, num_blocks, seed=seed, device=self.case.sender_device)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        self.receiver.close()
        self.server.stop(grace=None)


@pytest.fixture
def make_harness(case: Case) -> Iterator:
    made: list[Harness] = []

    def make(layout: KVLayout = SMALL, **sink_kwargs) -> Harness:
        sink = RecordingSink(layout, device=case.sink_device, **sink_kwargs)
        made.append(Harness(case, sink))
        return made[-1]

    yield make
    for harness in made:
        harness.close()
    for harness in made:  # after close: a destination still open here would be a leak
        harness.sink.assert_each_settled_once()
    assert read_ahead_threads_gone()  # nor may a receiver's thread outlive its handoffs


# The ipc sender stages every block before its one call: a sender that stops or dies while staging has opened
# nothing on the receiver (nothing there to fail), where the others have opened the handoff and must fail it.
STAGES_BEFORE_OPENING = {"ipc"}


def _sender_gave_up(case: Case, sink: RecordingSink, *, what: str) -> RecordingDestination | None:
    """After a sender stopped mid-transfer: the destination it had opened, failed within 10 s (never committed);
    None for a transport that stages before opening, which must have opened nothing. Every block is free."""
    if case.transport in STAGES_BEFORE_OPENING:
        assert sink.open_calls == 0 and not sink.destinations, f"{what}: a handoff was opened"
        assert sink.num_used == 0
        return None
    assert _wait_settled(sink, 10) < 10
    dest = sink.only()
    assert dest.outcome == "failed" and dest.commits == 0, what
    assert sink.num_used == 0
    return dest


def _wait_settled(sink: RecordingSink, timeout_s: float) -> float:
    """Wait until the sink's only destination settles; seconds it took."""
    start_s = time.monotonic()
    deadline_s = start_s + timeout_s
    dest = sink.wait_opened(timeout_s)
    assert dest.settled.wait(max(deadline_s - time.monotonic(), 0)), "destination neither committed nor failed"
    return time.monotonic() - start_s


# ── happy path ───────────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("layout", "num_tokens"),
    [
        pytest.param(SMALL, 1, id="1-token"),
        pytest.param(SMALL, 8, id="2-full-blocks"),
        pytest.param(SMALL_BF16, 37, id="bf16-partial-last"),
        pytest.param(SMOLLM2, 187, id="8.6MB-partial-last"),
        pytest.param(SMOLLM2_B32, 64 * 32 - 3, id="94MB-1.4MB-blocks"),
        pytest.param(SPLIT_BY_LAYERS, 1100 + 7, id="9MB-4.3MB-blocks-split-by-layers"),
        pytest.param(SPLIT_BY_BYTES, 1600 + 7, id="13MB-6.3MB-blocks-split-by-bytes"),
        pytest.param(FP8, 4 * 3 + 1, id="fp8-small-partial-last"),
        pytest.param(FP8_SMOLLM2, 187, id="fp8-smollm2-2.2MB"),
    ],
)
def test_round_trip_is_byte_exact(make_harness, layout: KVLayout, num_tokens: int) -> None:
    handoff = make_handoff(layout, num_tokens)
    harness = make_harness(layout, num_cache_blocks=handoff.num_blocks + 1)
    source = harness.source(handoff.num_blocks)

    result = harness.sender().send(handoff, source, endpoint=harness.endpoint, timeout_s=60)

    dest = harness.sink.only()
    assert dest.outcome == "committed"
    assert dest.written == list(range(handoff.num_blocks))
    # The whole last block travels, its unused tail included: compare every byte.
    assert torch.equal(dest.blocks().cpu().view(torch.uint8), source.blocks.cpu().view(torch.uint8))
    assert result.num_bytes == handoff.num_bytes == handoff.num_blocks * layout.block_bytes


@pytest.mark.parametrize(("num_tokens", "first_block"), [(4 * 5 + 3, 3), (4 * 2 + 1, 2)],
                         ids=["3-of-6-held", "all-but-the-last-held"])
def test_blocks_the_receiver_holds_stay_home(make_harness, num_tokens: int, first_block: int) -> None:
    """A handoff whose first blocks the receiver already holds (its own prefix cache) moves only the rest, each
    under its handoff-wide index; the held slots are never written."""
    handoff = dataclasses.replace(make_handoff(SMALL, num_tokens), first_block=first_block)
    harness = make_harness(SMALL)
    source = harness.source(handoff.num_blocks)

    result = harness.sender().send(handoff, source, endpoint=harness.endpoint, timeout_s=30)

    dest = harness.sink.only()
    assert dest.outcome == "committed"
    assert dest.written == list(range(first_block, handoff.num_blocks))
    assert torch.equal(dest.blocks()[first_block:].cpu(), source.blocks[first_block:].cpu())
    assert not dest.blocks()[:first_block].any()  # the held slots: never touched
    assert result.num_bytes == handoff.num_bytes == (handoff.num_blocks - first_block) * SMALL.block_bytes


def test_sender_stopping_after_the_held_head_fails_the_destination(case: Case, make_harness) -> None:
    harness = make_harness(SMALL)
    sender = harness.sender(TransferFault(stop_after_blocks=1))
    handoff = dataclasses.replace(make_handoff(SMALL, 4 * 6), first_block=2)

    with pytest.raises(KVTransferError, match="stopped after 1 blocks"):
        sender.send(handoff, harness.source(handoff.num_blocks), endpoint=harness.endpoint, timeout_s=10)

    dest = _sender_gave_up(case, harness.sink, what="stopped after the held head")
    assert dest is None or dest.written in ([], [2])


def test_sender_is_reusable_and_thread_safe_across_two_senders(make_harness) -> None:
    harness = make_harness(SMALL)
    senders = [harness.sender(worker_id="prefill-0"), harness.sender(worker_id="prefill-1")]
    jobs = [(senders[i % 2], make_handoff(SMALL, 4 * (i + 1) + 1, request_id=f"r{i}"), i) for i in range(8)]
    sources = {handoff.transfer_id: harness.source(handoff.num_blocks, seed=seed) for _, handoff, seed in jobs}
    errors: list[BaseException] = []

    def run(sender: KVSender, handoff, seed: int) -> None:
        try:
            sender.send(handoff, sources[handoff.transfer_id], endpoint=harness.endpoint, timeout_s=30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(harness.sink.destinations) == len(jobs)
    for dest in harness.sink.destinations:
        assert dest.outcome == "committed"
        assert torch.equal(dest.blocks().cpu(), sources[dest.handoff.transfer_id].blocks.cpu())


# ── refusals ─────────────────────────────────────────────────────────────────────────────────────────────────


def test_layout_mismatch_is_refused_before_any_byte(make_harness) -> None:
    harness = make_harness(SMALL)
    theirs = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
    handoff = make_handoff(theirs, 9)

    with pytest.raises(KVLayoutMismatch, match=r"head_dim: ours 8, peer's 16.*dtype"):
        harness.sender().send(handoff, harness.source(handoff.num_blocks, layout=theirs),
                              endpoint=harness.endpoint, timeout_s=10)

    assert harness.sink.open_calls == 0 and not harness.sink.destinations  # never opened, so never failed
    assert not harness.sink.cache.any()


@pytest.mark.parametrize(
    "refusal",
    [KVTransferError("no free KV blocks for request req"), KVLayoutMismatch("block_size: ours 4, peer's 8")],
    ids=["no-room", "sink-says-mismatch"],
)
def test_sink_refusal_reaches_the_sender(make_harness, refusal: KVTransferError) -> None:
    harness = make_harness(SMALL, refuse=refusal)
    handoff = make_handoff(SMALL, 9)

    with pytest.raises(type(refusal), match=str(refusal)):
        harness.sender().send(handoff, harness.source(handoff.num_blocks), endpoint=harness.endpoint, timeout_s=10)

    assert harness.sink.open_calls == 1 and not harness.sink.destinations


@pytest.mark.parametrize("layout", [pytest.param(SMALL, id="whole"), pytest.param(SPLIT_BY_LAYERS, id="split")])
def test_corrupted_block_fails_and_never_commits(make_harness, layout: KVLayout) -> None:
    harness = make_harness(layout)
    handoff = make_handoff(layout, layout.block_size * 4)

    with pytest.raises(KVChecksumError, match="block 1"):
        harness.sender(TransferFault(corrupt_block=1)).send(
            handoff, harness.source(handoff.num_blocks), endpoint=harness.endpoint, timeout_s=10
        )

    dest = harness.sink.only()
    assert dest.outcome == "failed" and "CRC" in dest.fail_reasons[0]
    # The bad block's write raised (its bytes may sit in its slot, which the failed handoff released unread) and
    # nothing after it was written.
    assert 1 not in dest.written and 2 not in dest.written


def test_unreachable_receiver_raises(case: Case) -> None:
    endpoint = "127.0.0.1:1"  # nothing listens on port 1 (and no in-process receiver is attached there)
    sender = make_sender(case.transport, worker_id="p", device=torch.device(case.sender_device))
    handoff = make_handoff(SMALL, 4)
    start_s = time.monotonic()
    try:
        with pytest.raises(KVTransferError, match="127.0.0.1:1"):
            sender.send(handoff, PatternSource(SMALL, 1, device=case.sender_device), endpoint=endpoint, timeout_s=5)
    finally:
        sender.close()
    assert time.monotonic() - start_s < 5 + SLACK_S


# ── the sender gives up mid-transfer ─────────────────────────────────────────────────────────────────────────


def test_sender_stopping_mid_transfer_fails_the_destination(case: Case, make_harness) -> None:
    harness = make_harness(SMALL)
    sender = harness.sender(TransferFault(stop_after_blocks=2))
    handoff = make_handoff(SMALL, 4 * 6)

    with pytest.raises(KVTransferError, match="stopped after 2 blocks"):
        sender.send(handoff, harness.source(handoff.num_blocks), endpoint=harness.endpoint, timeout_s=10)

    _sender_gave_up(case, harness.sink, what="stopped after 2 blocks")

    # The same sender (and, for torch, a rebuilt pair group) serves the next handoff.
    sender.fault = TransferFault()  # type: ignore[attr-defined]
    retry = make_handoff(SMALL, 4 * 6)
    source = harness.source(retry.num_blocks, seed=1)
    sender.send(retry, source, endpoint=harness.endpoint, timeout_s=10)
    committed = [d for d in harness.sink.destinations if d.outcome == "committed"]
    assert len(committed) == 1 and torch.equal(committed[0].blocks().cpu(), source.blocks.cpu())


# ── a peer process dies or freezes mid-transfer ──────────────────────────────────────────────────────────────


class Peer:
    """The other end in a subprocess; its stdout lines (READY, OPENED, WROTE, STALL, ERROR, SENT) in a queue."""

    EXITED = "\0exited"  # queued once its stdout closes: no line can follow

    def __init__(self, role: str, case: Case, layout: KVLayout, log_path: Path, *extra: str) -> None:
        self._log = log_path.open("w")
        python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kv_transfer.transfer_peer", role, "--transport", case.transport,
             "--layout", format_layout(layout), *extra],
            cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        self.log_path = log_path
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(self.EXITED)

    def expect(self, prefix: str, timeout_s: float = 30) -> str:
        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(deadline_s - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"peer never printed {prefix!r}; its log:\n{self.log_path.read_text()}") from None
            if line == self.EXITED:
                self.lines.put(line)  # for a later expect
                raise AssertionError(f"peer exited before printing {prefix!r}; its log:\n{self.log_path.read_text()}")
            if line.startswith(prefix):
                return line

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def peers(tmp_path: Path) -> Iterator:
    made: list[Peer] = []

    def spawn(role: str, case: Case, layout: KVLayout, *extra: str) -> Peer:
        made.append(Peer(role, case, layout, tmp_path / f"peer-{len(made)}.log", *extra))
        return made[-1]

    yield spawn
    for peer in made:
        peer.close()


@pytest.fixture(params=DEAD_PEER_TRANSPORTS)
def wire_case(request: pytest.FixtureRequest) -> Case:
    return request.param


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_sender_dying_mid_transfer_fails_the_destination(wire_case: Case, peers, how: str) -> None:
    """A sender process stalls inside its source after 2 blocks; then it is SIGKILLed, or left frozen: either way
    the receiver fails the destination, at once for a dead peer and by the sender's deadline for a silent one."""
    sink = RecordingSink(SMOLLM2, device=wire_case.sink_device)
    server, endpoint, receiver = serve_receiver(wire_case.transport, sink)
    timeout_s = 2.5
    try:
        sender = peers("sender", wire_case, SMOLLM2, "--device", wire_case.sender_device, "--endpoint", endpoint,
                       "--num-tokens", str(16 * 8), "--stall-at-block", "2", "--timeout-s", str(timeout_s))
        sender.expect("STALL")
        if wire_case.transport in STAGES_BEFORE_OPENING:  # it dies staging: nothing was opened, nothing may be
            if how == "killed":
                sender.signal(signal.SIGKILL)
            time.sleep(timeout_s + SLACK_S)
            assert sink.open_calls == 0 and sink.num_used == 0
            return
        dest = sink.wait_opened(SLACK_S)  # the blocks before the stall may still be on their way
        killed_s = time.monotonic()
        if how == "killed":
            sender.signal(signal.SIGKILL)
        assert dest.settled.wait(timeout_s + SLACK_S), "the receiver never failed the destination"
        assert dest.outcome == "failed"
        assert dest.settled_at_s is not None
        if how == "killed":
            assert dest.settled_at_s - killed_s < SLACK_S, "a dead sender must fail the handoff at once"
    finally:
        receiver.close()
        server.stop(grace=None)
    sink.assert_each_settled_once()


@pytest.mark.parametrize(
    ("how", "when"), [("killed", "OPENED"), ("killed", "WROTE 0"), ("frozen", "OPENED")],
    ids=["killed-on-open", "killed-mid-write", "frozen-on-open"],
)
def test_receiver_dying_mid_transfer_raises_on_the_sender(wire_case: Case, peers, how: str, when: str) -> None:
    """The receiver process is SIGKILLed or SIGSTOPped as its sink opens the handoff, or SIGKILLed once its slow
    sink is writing blocks (gRPC: mid-stream; torch: after the bytes moved, before the commit): the sender raises
    KVTransferError, never later than timeout_s plus slack."""
    receiver = peers("receiver", wire_case, SMOLLM2, "--device", wire_case.sink_device, "--write-delay-s", "0.5")
    endpoint = receiver.expect("READY").split()[1]
    handoff = make_handoff(SMOLLM2, 16 * 12)
    source = PatternSource(SMOLLM2, handoff.num_blocks, device=wire_case.sender_device)
    sender = make_sender(wire_case.transport, worker_id="prefill-0", device=torch.device(wire_case.sender_device))
    timeout_s = 2.5
    outcome: list[BaseException | None] = []

    def send() -> None:
        try:
            sender.send(handoff, source, endpoint=endpoint, timeout_s=timeout_s)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    thread = threading.Thread(target=send)
    start_s = time.monotonic()
    thread.start()
    try:
        receiver.expect(when)
        receiver.signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        thread.join(timeout_s + SLACK_S)
        assert not thread.is_alive(), "the sender hung past its timeout"
        assert time.monotonic() - start_s < timeout_s + SLACK_S
        assert outcome and isinstance(outcome[0], KVTransferError), outcome
        if how == "frozen":  # no answer by the deadline: said as a timeout (kv_transfer/handoff_failure.py)
            assert isinstance(outcome[0], KVTransferTimeout), outcome
    finally:
        receiver.close()
        thread.join(timeout=10)
        sender.close()


# ── quantized blocks (--kv-cache-dtype int8) ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("layout", "num_tokens"),
    [
        pytest.param(INT8, 4 * 3 + 1, id="small-partial-last"),
        pytest.param(INT8_SMOLLM2, 187, id="smollm2-2.2MB"),
        pytest.param(INT8_SPLIT, 6200 + 7, id="12MB-split"),
    ],
)
def test_quantized_round_trip_carries_values_and_scales_bit_exact(make_harness, layout: KVLayout,
                                                                  num_tokens: int) -> None:
    """An int8 block's values and scales land bit for bit, in the bytes the engine's cache costs per block."""
    handoff = make_handoff(layout, num_tokens)
    harness = make_harness(layout, num_cache_blocks=handoff.num_blocks + 2)
    source = harness.source(handoff.num_blocks)

    result = harness.sender().send(handoff, source, endpoint=harness.endpoint, timeout_s=60)

    dest = harness.sink.only()
    assert dest.outcome == "committed" and dest.written == list(range(handoff.num_blocks))
    assert source.scales is not None
    assert torch.equal(dest.blocks().cpu(), source.blocks.cpu())
    assert torch.equal(dest.block_scales().cpu().view(torch.int32), source.scales.cpu().view(torch.int32))
    assert harness.sink.num_used == handoff.num_blocks  # held by the committed handoff, no more
    assert result.num_bytes == handoff.num_bytes == handoff.num_blocks * layout.block_bytes


def test_quantized_handoff_moves_about_a_quarter_of_float32s_bytes(make_harness) -> None:
    """At SmolLM2-135M's shape, an int8 handoff moves the engine's int8 block bytes (scales included): 0.251x of
    float32's."""
    model = dummy_model_config("smollm2-135m")
    assert (INT8_SMOLLM2.num_layers, INT8_SMOLLM2.num_kv_heads, INT8_SMOLLM2.head_dim) == (
        model.num_layers, model.num_kv_heads, model.head_dim)
    results = {}
    for layout in (SMOLLM2, INT8_SMOLLM2):
        handoff = make_handoff(layout, 16 * 4)
        harness = make_harness(layout, num_cache_blocks=handoff.num_blocks)
        results[layout.kv_cache_dtype] = harness.sender().send(
            handoff, harness.source(handoff.num_blocks), endpoint=harness.endpoint, timeout_s=30).num_bytes
        assert harness.sink.only().outcome == "committed"

    assert results["int8"] == 4 * kv_block_bytes(model, 16, torch.float32, "int8") == 4 * (184_320 + 720)
    assert results["auto"] == 4 * kv_block_bytes(model, 16, torch.float32, "auto")
    assert 0.25 < results["int8"] / results["auto"] < 0.26


@pytest.mark.parametrize(("ours", "theirs"), [(INT8, SMALL), (SMALL, INT8), (FP8, SMALL_BF16), (SMALL_BF16, FP8)],
                         ids=["int8-receiver-float32-sender", "float32-receiver-int8-sender",
                              "fp8-receiver-bfloat16-sender", "bfloat16-receiver-fp8-sender"])
def test_kv_cache_dtype_mismatch_is_refused_before_any_byte(make_harness, ours: KVLayout, theirs: KVLayout) -> None:
    harness = make_harness(ours)
    handoff = make_handoff(theirs, 9)

    with pytest.raises(KVLayoutMismatch, match=f"kv_cache_dtype: ours '{ours.kv_cache_dtype}', "
                                               f"peer's '{theirs.kv_cache_dtype}'"):
        harness.sender().send(handoff, harness.source(handoff.num_blocks, layout=theirs),
                              endpoint=harness.endpoint, timeout_s=10)

    assert harness.sink.open_calls == 0 and not harness.sink.destinations and harness.sink.num_used == 0
    assert not harness.sink.cache.view(torch.uint8).any()
    assert harness.sink.scales is None or not harness.sink.scales.any()


def test_corrupted_scale_byte_fails_the_checksum_and_frees_every_block(make_harness) -> None:
    harness = make_harness(INT8)
    handoff = make_handoff(INT8, 4 * 4)
    fault = TransferFault(corrupt_block=1, corrupt_byte=-1)  # the last scale's top byte: the values are intact
    assert INT8.block_bytes + fault.corrupt_byte >= INT8.value_bytes

    with pytest.raises(KVChecksumError, match="block 1"):
        harness.sender(fault).send(handoff, harness.source(handoff.num_blocks), endpoint=harness.endpoint,
                                   timeout_s=10)

    dest = harness.sink.only()
    assert dest.outcome == "failed" and "CRC" in dest.fail_reasons[0]
    assert 1 not in dest.written and 2 not in dest.written
    assert harness.sink.num_used == 0


def test_quantized_sender_stopping_mid_transfer_frees_every_block(case: Case, make_harness) -> None:
    harness = make_harness(INT8)
    handoff = make_handoff(INT8, 4 * 6)

    with pytest.raises(KVTransferError, match="stopped after 2 blocks"):
        harness.sender(TransferFault(stop_after_blocks=2)).send(
            handoff, harness.source(handoff.num_blocks), endpoint=harness.endpoint, timeout_s=10)

    _sender_gave_up(case, harness.sink, what="an int8 handoff stopped after 2 blocks")
