"""The sender/receiver interface every transport implements, and the two ends it plugs into.

    prefill worker                                             decode worker
    ──────────────                                             ─────────────
    KVBlockSource ──▶ KVSender.send(handoff, source, endpoint) ──wire──▶ KVReceiver ──▶ KVSink.open(handoff)
      (reads held blocks)        raises KVTransferError                                   └▶ KVDestination
                                 on refusal, timeout, dead peer,                             .write_block(i, data, crc)
                                 bad checksum                                                  (verified as copied)
                                                                                             .commit() | .fail(why)

Ownership: the sender's blocks stay held until `send` returns (the receiver confirmed every block) or raises
(the receiver failed the destination, or the timeout passed); the caller frees them either way. On the receiving
side, exactly one of `commit` / `fail` is called on every destination `open` returned, so the decode worker
frees a reservation whose transfer never completed.
"""

from __future__ import annotations

import abc
import collections
import threading
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch

from kv_transfer.layout import KVChecksumError, KVHandoff, KVLayout, KVTransferError, block_checksum, rejection_reason
from kv_transfer.stage_clock import StageLog


class KVBlockSource(Protocol):
    """The sender's view of one handoff's blocks."""

    layout: KVLayout

    def read_block(self, index: int) -> torch.Tensor:
        """Block `index` of the handoff: a tensor of `layout.wire_shape` and `wire_dtype` on the source's device,
        possibly a strided view of the paged cache (transports gather it as they copy it out; it must not change
        while held). `kv_transfer.wire_block.read_wire_block` makes it from the cache's views."""
        ...

    # Optional: `read_blocks(indices: range, out: torch.Tensor) -> None` copies blocks `indices` into `out`
    # ([len(indices), *wire_shape], contiguous) at once (kv_transfer.wire_block.read_wire_blocks); see read_blocks.


class KVDestination(Protocol):
    """Where one handoff's blocks land on the receiver: reserved blocks of its paged cache."""

    def write_block(self, index: int, data: torch.Tensor, crc32c: int | None = None) -> None:
        """Store block `index` (a tensor of `layout.wire_shape`) with `kv_transfer.wire_block.write_wire_block`,
        which verifies `data` (values and scales) against the sender's `crc32c` as it copies and raises
        KVChecksumError on a mismatch (the receiver then fails the handoff, so the block's bytes are never read).
        None: `data` needs no check."""
        ...

    # Optional: `write_blocks(first_index: int, data: torch.Tensor) -> None` stores blocks first_index, ... of
    # `data` ([k, *wire_shape]) at once and unchecked (kv_transfer.wire_block.write_wire_blocks); see write_blocks.

    def commit(self) -> None:
        """Every block arrived and verified; the request may run."""
        ...

    def fail(self, reason: str) -> None:
        """The handoff failed; the reservation must be released. Idempotent."""
        ...


class SettleOnce:
    """A KVDestination wrapper that lets exactly one of commit / fail through, whichever comes first.

    Receivers wrap every destination the sink opens, so that a `close()` racing a handler thread, or an error
    after a failed commit, can never commit a failed handoff or fail a committed one."""

    def __init__(self, dest: KVDestination) -> None:
        self._dest = dest
        self._lock = threading.Lock()
        self.outcome: str | None = None  # None (open), "committed" or "failed"

    def write_block(self, index: int, data: torch.Tensor, crc32c: int | None = None) -> None:
        if self.outcome is not None:
            raise KVTransferError(f"write to a destination already {self.outcome}")
        self._dest.write_block(index, data, crc32c)

    def write_blocks(self, first_index: int, data: torch.Tensor) -> None:
        if self.outcome is not None:
            raise KVTransferError(f"write to a destination already {self.outcome}")
        write_blocks(self._dest, first_index, data)

    @property
    def scatters(self) -> bool:
        """Whether the destination stores many blocks at once (`write_blocks`), in one scatter: a transport may then
        write them before it has verified them, as long as it verifies before it commits."""
        return getattr(self._dest, "write_blocks", None) is not None

    def commit(self) -> None:
        """Commit, or raise KVTransferError when the handoff was failed first (by `close`, a timeout)."""
        with self._lock:
            if self.outcome is not None:
                raise KVTransferError(f"commit of a destination already {self.outcome}")
            self._dest.commit()
            self.outcome = "committed"

    def fail(self, reason: str) -> None:
        """Fail unless already settled; later calls do nothing."""
        with self._lock:
            if self.outcome is not None:
                return
            self.outcome = "failed"
        self._dest.fail(reason)


class KVSink(Protocol):
    """The receiver's owner (the decode worker)."""

    layout: KVLayout
    device: torch.device

    def open(self, handoff: KVHandoff) -> KVDestination:
        """Find (or make) the destination for a handoff. Raises KVTransferError to refuse it."""
        ...


@dataclass(frozen=True, kw_only=True)
class TransferResult:
    num_bytes: int
    seconds: float
    stages_s: dict[str, float] = field(default_factory=dict)  # the sender's stages (kv_transfer.stage_clock)
    marks_s: dict[str, float] = field(default_factory=dict)  # and its marks: "call", when its call left


@dataclass(frozen=True, kw_only=True)
class TransferFault:
    """Test hook: make a sender misbehave on purpose (the conformance suite's corrupted-block case)."""

    corrupt_block: int | None = None  # flip a byte of this block after its checksum is taken
    corrupt_byte: int = 0  # which byte of its wire bytes; negative counts from the end (-1: an int8 block's scale)
    stop_after_blocks: int | None = None  # die (raise, drop the connection) after sending this many blocks

    def apply(self, index: int, block: torch.Tensor) -> torch.Tensor:
        """Block `index` as the faulty sender puts it on the wire: a copy with byte `corrupt_byte` flipped when it
        is `corrupt_block`, else `block` itself. Call it after the checksum is taken."""
        if index != self.corrupt_block:
            return block
        corrupted = block.clone()
        flat = corrupted.view(-1).view(torch.uint8)
        flat.narrow(0, self.corrupt_byte % flat.numel(), 1).bitwise_xor_(0xFF)  # a view: writing it writes the copy
        return corrupted


def check_receivable(sink: KVSink, handoff: KVHandoff) -> None:
    """Raise KVLayoutMismatch unless `sink` can take `handoff`'s layout: through the sink's own `check(handoff)` when
    it has one (a sink whose destinations differ in layout: kv_transfer/reservation.py), else against its layout."""
    check = getattr(sink, "check", None)
    if check is not None:
        check(handoff)
    else:
        handoff.check_receiver(sink.layout)


def write_verified(dest: KVDestination, handoff: KVHandoff, index: int, block: torch.Tensor, crc32c: int) -> None:
    """`dest.write_block(index, block, crc32c)`, a checksum mismatch reported with the handoff and block it hit."""
    try:
        dest.write_block(index, block, crc32c)
    except KVChecksumError as exc:
        raise KVChecksumError(
            f"handoff {handoff.transfer_id}: block {index} failed its CRC-32C check ({exc})"
        ) from None


def read_blocks(source: KVBlockSource, indices: range, out: torch.Tensor) -> None:
    """Blocks `indices` of `source` into `out` ([len(indices), *wire_shape], contiguous): in one gather when the
    source has `read_blocks`, else block by block."""
    gather_all = getattr(source, "read_blocks", None)
    if gather_all is not None:
        gather_all(indices, out)
        return
    for slot, index in enumerate(indices):
        out[slot].copy_(source.read_block(index))


def write_blocks(dest: KVDestination, first_index: int, data: torch.Tensor) -> None:
    """Store `data`'s k blocks as blocks first_index, ... of `dest`, unchecked (the caller verifies them before it
    commits): at once when the destination has `write_blocks`, else block by block."""
    scatter_all = getattr(dest, "write_blocks", None)
    if scatter_all is not None:
        scatter_all(first_index, data)
        return
    for slot in range(data.shape[0]):
        dest.write_block(first_index + slot, data[slot], None)


def block_bytes(block: torch.Tensor) -> memoryview:
    """The raw bytes of one contiguous block, copied to host memory first when it lives on a GPU."""
    if not block.is_contiguous():
        raise ValueError("a KV block on the wire must be a contiguous tensor")
    host = block if block.device.type == "cpu" else block.cpu()
    return memoryview(host.view(-1).view(torch.uint8).numpy())


def tensor_checksum(block: torch.Tensor) -> int:
    """`block_checksum` of a block tensor's bytes."""
    return block_checksum(block_bytes(block))


class KVSender(abc.ABC):
    """One per prefill worker; thread-safe: concurrent `send`s to the same or different receivers."""

    name: str

    @abc.abstractmethod
    def send(self, handoff: KVHandoff, source: KVBlockSource, *, endpoint: str, timeout_s: float) -> TransferResult:
        """Move every block to the receiver at `endpoint` and wait for its confirmation.

        Returns once the receiver committed; raises KVTransferError (KVLayoutMismatch, KVChecksumError, or a
        timeout / dead-peer error) otherwise. Never returns before the receiver has verified every block."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections and groups."""


class KVReceiver(abc.ABC):
    """One per decode worker. Serves its transport's wire side and hands blocks to the sink."""

    name: str

    def __init__(self, sink: KVSink) -> None:
        self.sink = sink
        self._rejections: collections.Counter[str] = collections.Counter()
        self._rejections_lock = threading.Lock()
        self.stage_log = StageLog()  # each handoff's stages on this side (kv_transfer.stage_clock)

    def note_failure(self, exc: BaseException) -> None:
        """Count a handoff refused or failed on this side, when the error is a refusal (`rejection_reason`)."""
        reason = rejection_reason(exc)
        if reason is not None:
            with self._rejections_lock:
                self._rejections[reason] += 1

    def rejections(self) -> dict[str, int]:
        """Handoffs refused so far, by reason (splitserve:kv_transfers_rejected_total)."""
        with self._rejections_lock:
            return dict(self._rejections)

    @abc.abstractmethod
    def attach(self, server: grpc.Server, endpoint: str) -> None:
        """Serve this transport through the worker's gRPC server (called before `server.start()`); `endpoint` is
        that server's address, which senders pass to `KVSender.send`."""

    def close(self) -> None:  # noqa: B027 - optional
        """Stop serving; destinations still open are failed."""
