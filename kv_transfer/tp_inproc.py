"""A KV handoff between engines of different tensor-parallel sizes in one process: slices of every block move from
the sender's ranks' caches to the receiver's ranks' caches by tensor copies (kv_transfer/tp_plan.py says which).

    TPSender.send(handoff, source) ──lookup(endpoint)──▶ TPReceiver.open(handoff)
                                                           plan = plan_tp_handoff(handoff.layout, sink.layout)
                                                           dest = sink.open(handoff)   (one reservation: every
                                                                                        rank holds the same block ids)
        for each block, for each slice of the plan:
            source.read_slice(sender_rank, block, sender_heads) ──▶ dest.write_slice(receiver_rank, block,
              (gather + CRC-32C, one pass)                                              receiver_heads, data, crc)
                                                                    verified as copied; KVChecksumError fails all
        commit: only when every slice of every block reached every receiver rank; else KVTransferError
        any failure: dest.fail(reason), once (SettleOnce), which frees the reservation on every rank

This is item 3 of issue 33's foundation, not yet a transport the workers use: a TP engine's ranks 1..N-1 live in
their own processes (engine/distributed/rank_worker.py), so their caches are not in the worker's process; what
the workers need on top is each rank serving its own slices (see the issue). The registry is this module's own,
apart from `inproc_transport`'s, whose blocks are whole.

Blocks on a GPU go through the host for their CRC-32C (`gather`): correct, not fast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kv_transfer.base import SettleOnce, TransferFault, TransferResult
from kv_transfer.layout import KVChecksumError, KVHandoff, KVLayout, KVTransferError, KVTransferTimeout
from kv_transfer.tp_plan import TPHandoffPlan, plan_tp_handoff, slice_layout
from kv_transfer.tp_slices import RankCache


class TPBlockSource(Protocol):
    """The sender's view of one handoff's blocks, over all its ranks (`layout.tensor_parallel_size` of them)."""

    layout: KVLayout

    def read_slice(self, rank: int, index: int, local_heads: range) -> tuple[torch.Tensor, int]:
        """Rank `rank`'s local heads `local_heads` of handoff block `index`: a contiguous wire slice and its
        CRC-32C (`RankCache.read_slice`). The blocks stay held (unchanged) until `send` returns."""
        ...


class TPDestination(Protocol):
    """Where one handoff's slices land: one reservation of block ids, the same on every receiver rank."""

    def write_slice(self, rank: int, index: int, local_heads: range, data: torch.Tensor, crc32c: int) -> None:
        """Store a wire slice as rank `rank`'s local heads `local_heads` of handoff block `index`, raising
        KVChecksumError unless it matches `crc32c` (`RankCache.write_slice`)."""
        ...

    def commit(self) -> None:
        """Every slice of every block arrived on every rank, verified; the request may run."""
        ...

    def fail(self, reason: str) -> None:
        """The handoff failed; the reservation (every rank's blocks) must be released. Idempotent."""
        ...


class TPSink(Protocol):
    """The receiver's owner: an engine of `layout` (its tensor-parallel size may differ from the sender's)."""

    layout: KVLayout

    def open(self, handoff: KVHandoff) -> TPDestination:
        """Find (or make) the destination for a handoff; raise KVTransferError to refuse it."""
        ...


@dataclass(frozen=True, kw_only=True)
class RankCachesSource:
    """A TPBlockSource over one engine's rank caches: handoff block `i` is cache block `block_ids[i]` of every rank."""

    layout: KVLayout
    ranks: Sequence[RankCache]
    block_ids: Sequence[int]

    def read_slice(self, rank: int, index: int, local_heads: range) -> tuple[torch.Tensor, int]:
        return self.ranks[rank].read_slice(self.block_ids[index], local_heads)


class RankCachesDestination:
    """A TPDestination over one engine's rank caches: handoff block `i` lands in cache block `block_ids[i]` of every
    rank; `on_commit` / `on_fail(reason)` settle the reservation (the caller's, e.g. the block pool's)."""

    def __init__(self, ranks: Sequence[RankCache], block_ids: Sequence[int], *, on_commit: Callable[[], None],
                 on_fail: Callable[[str], None]) -> None:
        self.ranks = ranks
        self.block_ids = block_ids
        self._on_commit = on_commit
        self._on_fail = on_fail

    def write_slice(self, rank: int, index: int, local_heads: range, data: torch.Tensor, crc32c: int) -> None:
        self.ranks[rank].write_slice(self.block_ids[index], local_heads, data, crc32c)

    def commit(self) -> None:
        self._on_commit()

    def fail(self, reason: str) -> None:
        self._on_fail(reason)


SCHEME = "inproc-tp://"
_registry_lock = threading.Lock()
_registry: dict[str, TPReceiver] = {}


def _key(endpoint: str) -> str:
    return endpoint[len(SCHEME):] if endpoint.startswith(SCHEME) else endpoint


class _Incoming:
    """One open handoff on the receiver: which slices of which blocks arrived. Commits only when all did."""

    def __init__(self, handoff: KVHandoff, plan: TPHandoffPlan, dest: TPDestination) -> None:
        self.handoff = handoff
        self.plan = plan
        self.dest = SettleOnce(dest)  # type: ignore[arg-type]  # only commit / fail go through it
        self._inner = dest
        self.arrived: set[tuple[int, int]] = set()  # (block index, slice number)

    def write(self, index: int, slice_no: int, data: torch.Tensor, crc32c: int) -> None:
        tid = self.handoff.transfer_id
        if index not in self.handoff.block_indices or not 0 <= slice_no < len(self.plan.slices):
            raise KVTransferError(f"handoff {tid}: slice {slice_no} of block {index} is not part of the handoff")
        if (index, slice_no) in self.arrived:
            raise KVTransferError(f"handoff {tid}: slice {slice_no} of block {index} arrived twice")
        s = self.plan.slices[slice_no]
        expected = slice_layout(self.plan.receiver, len(s.heads)).wire_shape
        if tuple(data.shape) != expected:
            raise KVTransferError(f"handoff {tid}: slice {slice_no} of block {index} has shape {tuple(data.shape)}, "
                                  f"expected {expected}")
        if self.dest.outcome is not None:
            raise KVTransferError(f"handoff {tid}: a slice after the destination was {self.dest.outcome}")
        try:
            self._inner.write_slice(s.receiver_rank, index, s.receiver_heads, data, crc32c)
        except KVChecksumError as exc:
            raise KVChecksumError(f"handoff {tid}: block {index}'s slice for receiver rank {s.receiver_rank} "
                                  f"(heads {s.heads.start}..{s.heads.stop - 1}) failed its CRC-32C check ({exc})"
                                  ) from None
        self.arrived.add((index, slice_no))

    def commit(self) -> None:
        expected = len(self.handoff.block_indices) * len(self.plan.slices)
        if len(self.arrived) != expected:
            raise KVTransferError(f"handoff {self.handoff.transfer_id}: commit after {len(self.arrived)} of "
                                  f"{expected} slices")
        self.dest.commit()


class TPReceiver:
    """The decode side: registered under an endpoint, opens a destination on its sink for each handoff."""

    name = "inproc-tp"

    def __init__(self, sink: TPSink) -> None:
        self.sink = sink
        self._endpoint: str | None = None

    def attach(self, endpoint: str) -> None:
        key = _key(endpoint)
        with _registry_lock:
            if key in _registry:
                raise ValueError(f"an in-process TP KV receiver is already attached at {endpoint!r}")
            _registry[key] = self
        self._endpoint = key

    def close(self) -> None:
        with _registry_lock:
            if self._endpoint is not None and _registry.get(self._endpoint) is self:
                del _registry[self._endpoint]
        self._endpoint = None

    def open(self, handoff: KVHandoff) -> _Incoming:
        """Plan the slices first (KVLayoutMismatch for another model's layout: nothing is opened), then ask the
        sink, which may refuse with KVTransferError."""
        plan = plan_tp_handoff(handoff.layout, self.sink.layout)
        return _Incoming(handoff, plan, self.sink.open(handoff))


class TPSender:
    """The prefill side; thread-safe (nothing mutable but the test fault)."""

    name = "inproc-tp"

    def __init__(self, *, fault: TransferFault | None = None) -> None:
        self.fault = fault or TransferFault()

    def send(self, handoff: KVHandoff, source: TPBlockSource, *, endpoint: str, timeout_s: float) -> TransferResult:
        """Move every slice of every block to the receiver at `endpoint` and commit there. Raises KVTransferError
        (KVLayoutMismatch, KVChecksumError, KVTransferTimeout, ...) after failing the destination, if one was
        opened. `fault.stop_after_blocks`: stop before that many blocks have gone; `fault.corrupt_block`: flip
        `corrupt_byte` of each of that block's slices after its CRC is taken."""
        start_s = time.monotonic()
        if source.layout != handoff.layout:
            raise KVTransferError(f"handoff {handoff.transfer_id}: the source's layout {source.layout} is not the "
                                  f"handoff's {handoff.layout}")
        with _registry_lock:
            receiver = _registry.get(_key(endpoint))
        if receiver is None:
            raise KVTransferError(f"no in-process TP KV receiver attached at {endpoint!r}")
        incoming = receiver.open(handoff)
        num_bytes = 0
        try:
            for num_sent, index in enumerate(handoff.block_indices):
                if num_sent == self.fault.stop_after_blocks:
                    raise KVTransferError(f"handoff {handoff.transfer_id}: sender stopped after {num_sent} blocks "
                                          "(fault)")
                if time.monotonic() - start_s > timeout_s:
                    raise KVTransferTimeout(f"handoff {handoff.transfer_id} to {endpoint} timed out after "
                                            f"{timeout_s}s")
                for slice_no, s in enumerate(incoming.plan.slices):
                    data, crc = source.read_slice(s.sender_rank, index, s.sender_heads)
                    incoming.write(index, slice_no, self.fault.apply(index, data), crc)
                    num_bytes += s.num_bytes
            incoming.commit()
        except BaseException as exc:
            incoming.dest.fail(f"in-process TP KV transfer failed: {exc}")
            if isinstance(exc, KVTransferError) or not isinstance(exc, Exception):
                raise
            raise KVTransferError(f"handoff {handoff.transfer_id} to {endpoint} failed: {exc}") from exc
        return TransferResult(num_bytes=num_bytes, seconds=time.monotonic() - start_s)
