"""The in-process KV transport: sender and receiver live in one process and blocks move by a tensor copy.

    Sender.send ──lookup(endpoint)──▶ Receiver (process-global registry, filled by `attach`)
        for each block: gather + checksum (one pass) ──▶ dest.write_block(i, block, crc) copies it and verifies
        then dest.commit

It still checksums on both sides, like the wire transports, so the conformance suite's corrupted-block case
means the same thing here: a corrupt block fails the handoff and never commits. There is no peer process that
can die; `TransferFault.stop_after_blocks` stands in for a sender dying mid-transfer.

Blocks on a GPU never touch the host: the copy is device to device, and instead of a CRC-32C (a host computation)
each side takes a digest of the block's bytes on the device (kv_transfer/device_digest.py). Comparing them is
the block's one synchronisation, and no byte of the block crosses to the host (a CRC there would copy it out on
both sides); a mismatch fails the handoff before the block is written, as a CRC mismatch does.
"""

from __future__ import annotations

import threading
import time

import grpc
import torch

from kv_transfer.base import (
    KVBlockSource,
    KVDestination,
    KVReceiver,
    KVSender,
    KVSink,
    TransferFault,
    TransferResult,
    check_receivable,
    write_verified,
)
from kv_transfer.block_copy import gather
from kv_transfer.device_digest import device_digest, device_digests  # noqa: F401 - device_digests: re-exported
from kv_transfer.layout import KVChecksumError, KVHandoff, KVTransferError, KVTransferTimeout
from kv_transfer.stage_clock import StageClock

SCHEME = "inproc://"

_registry_lock = threading.Lock()
_registry: dict[str, Receiver] = {}


def _key(endpoint: str) -> str:
    """`inproc://name` and `name` name the same receiver, so a worker's gRPC address works as is."""
    return endpoint[len(SCHEME):] if endpoint.startswith(SCHEME) else endpoint


class _Incoming:
    """One open handoff on the receiver: checks each block's order and shape; the destination verifies its
    checksum as it copies it."""

    def __init__(self, handoff: KVHandoff, dest: KVDestination) -> None:
        self.handoff = handoff
        self.dest = dest
        self.next_index = handoff.first_wire_block

    def write(self, index: int, block: torch.Tensor, check: int | torch.Tensor) -> None:
        """`check`: the sender's CRC-32C of a host block, or its `device_digest` of a device block."""
        self._check(index, block)
        if isinstance(check, torch.Tensor):  # device to device, checked there
            if not torch.equal(check, device_digest(block)):
                raise KVChecksumError(f"handoff {self.handoff.transfer_id}: block {index} failed its checksum (a "
                                      "device digest, in place of the CRC-32C: the block stayed on its GPU)")
            self.dest.write_block(index, block, None)
        else:
            write_verified(self.dest, self.handoff, index, block, check)  # verified as it is copied
        self.next_index += 1

    def _check(self, index: int, block: torch.Tensor) -> None:
        if index != self.next_index:
            raise KVTransferError(
                f"handoff {self.handoff.transfer_id}: block {index} arrived, block {self.next_index} expected"
            )
        if tuple(block.shape) != self.handoff.wire_layout.wire_shape:
            raise KVTransferError(
                f"handoff {self.handoff.transfer_id}: block {index} has shape {tuple(block.shape)}, "
                f"expected {self.handoff.wire_layout.wire_shape}"
            )

    def commit(self) -> None:
        if self.next_index != self.handoff.num_wire_blocks:
            raise KVTransferError(
                f"handoff {self.handoff.transfer_id}: commit before block {self.next_index} of "
                f"{self.handoff.num_wire_blocks}"
            )
        self.dest.commit()


class Receiver(KVReceiver):
    name = "inproc"

    def __init__(self, sink: KVSink) -> None:
        super().__init__(sink)
        self._endpoint: str | None = None

    def attach(self, server: grpc.Server | None, endpoint: str) -> None:
        """Register under `endpoint` (the worker's gRPC address or `inproc://name`); `server` is unused."""
        key = _key(endpoint)
        with _registry_lock:
            if key in _registry:
                raise ValueError(f"an in-process KV receiver is already attached at {endpoint!r}")
            _registry[key] = self
        self._endpoint = key

    def close(self) -> None:
        """Unregister. A handoff in progress runs on the sender's thread and finishes or fails there."""
        with _registry_lock:
            if self._endpoint is not None and _registry.get(self._endpoint) is self:
                del _registry[self._endpoint]
        self._endpoint = None

    def open(self, handoff: KVHandoff) -> _Incoming:
        """Check the layout before anything else, then ask the sink (which may refuse with KVTransferError)."""
        check_receivable(self.sink, handoff)
        return _Incoming(handoff, self.sink.open(handoff))


class Sender(KVSender):
    name = "inproc"

    def __init__(self, *, worker_id: str, device: torch.device, fault: TransferFault | None = None,
                 auth: object = None) -> None:  # auth: nothing leaves the process
        self.worker_id = worker_id
        self.device = torch.device(device)
        self.fault = fault or TransferFault()

    def send(self, handoff: KVHandoff, source: KVBlockSource, *, endpoint: str, timeout_s: float) -> TransferResult:
        start_s = time.monotonic()
        clock = StageClock()
        deadline_s = start_s + timeout_s
        with _registry_lock:
            receiver = _registry.get(_key(endpoint))
        if receiver is None:
            raise KVTransferError(f"no in-process KV receiver attached at {endpoint!r}")
        incoming = receiver.open(handoff)  # refusals propagate as they are: nothing was opened
        clock.lap("open")
        try:
            for num_sent, index in enumerate(handoff.wire_indices):
                if num_sent == self.fault.stop_after_blocks:
                    raise KVTransferError(
                        f"handoff {handoff.transfer_id}: sender stopped after {num_sent} blocks (fault)"
                    )
                if time.monotonic() > deadline_s:
                    raise KVTransferTimeout(f"handoff {handoff.transfer_id} to {endpoint} timed out after {timeout_s}s")
                view = source.read_block(index)  # a strided view of the sender's cache
                if view.device.type == "cpu":
                    block, check = gather(view)
                else:  # stays on the device: a digest there instead of a host CRC
                    block = view.contiguous()
                    check = device_digest(block)
                clock.lap("gather+crc")
                incoming.write(index, self.fault.apply(index, block), check)
                clock.lap("crc+copy")
            incoming.commit()
            clock.lap("commit")
        except BaseException as exc:
            incoming.dest.fail(f"in-process KV transfer failed: {exc}")
            if isinstance(exc, KVTransferError) or not isinstance(exc, Exception):
                raise
            raise KVTransferError(f"handoff {handoff.transfer_id} to {endpoint} failed: {exc}") from exc
        return TransferResult(num_bytes=handoff.num_bytes, seconds=time.monotonic() - start_s,
                              stages_s=clock.done().stages_s, marks_s=clock.marks_s)
