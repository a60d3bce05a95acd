"""The receiving side of a KV handoff: blocks reserved for one request, and the sink that finds them. A decode
worker reserves blocks of its paged cache for a prompt a prefill worker computes; any worker fetching a cached
prefix from a peer (worker/peer_fetch.py) reserves a staging buffer the same way.

A reservation's states (its lock makes each transition atomic with respect to block writes):

    RESERVED ──open──▶ RECEIVING ──commit──▶ COMMITTED          (the request may decode)
        │                  │
        └──────fail / cancel────▶ FAILED                         (the owner frees the blocks)

`cancel` is what the owner calls before freeing the blocks on abort or timeout: once it returns, no write is in
flight and none will start, so a late sender can never write into blocks that another request now owns.

No block enters the cache that nobody asked for: the sink opens a handoff only for a reservation this worker made
itself, and only when the handoff names the reservation's transfer id (a fresh random one per attempt, given to the
prefill worker in the Prefill call), comes from the prefill worker the gateway named, and carries the block count
and layout reserved. Anything else is refused (KVRefused / KVLayoutMismatch, counted by the receiver) before a
byte is written. Even a written block reaches the prefix cache only when the request commits (a failed handoff
frees its blocks unregistered).
"""

from __future__ import annotations

import enum
import hmac
import threading
from collections.abc import Sequence

import torch

from kv_transfer.layout import KVHandoff, KVLayout, KVRefused, KVTransferError
from kv_transfer.tp_slices import WireBlocks, rank_caches


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    COMMITTED = "committed"
    FAILED = "failed"


class Reservation:
    """A KVDestination over reserved blocks of the receiving worker's paged cache (or of a staging buffer)."""

    def __init__(
        self, request_id: str, num_tokens: int, block_ids: list[int], kv_cache: torch.Tensor, layout: KVLayout,
        *, first_block: int = 0, transfer_id: str = "", source_endpoint: str = "",
        kv_scales: torch.Tensor | None = None,
        ranks: Sequence[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ) -> None:
        """`block_ids[:first_block]` are held already (this worker's prefix cache, shared with other requests):
        the handoff must skip them, and no write may touch them. `transfer_id` and `source_endpoint` ("": any)
        are what the one handoff it accepts must name. `kv_cache` / `kv_scales`: the runner's; at
        tensor_parallel_size N, `ranks` is every rank's (`KVBlocks.ranks`), the same block ids reserved on each."""
        self.request_id = request_id
        self.transfer_id = transfer_id
        self.source_endpoint = source_endpoint
        self.num_tokens = num_tokens
        self.block_ids = block_ids
        self.first_block = first_block
        self.caches = rank_caches(layout, ranks or ((kv_cache, kv_scales),))
        self.layout = layout
        self._blocks: WireBlocks | None = None  # once open: the handoff's wire blocks in this worker's caches
        self._wire_range = range(0)  # the wire blocks the open handoff may write
        self.state = ReservationState.RESERVED
        self.error: str | None = None
        self.num_bytes = 0
        self.done = threading.Event()  # set on COMMITTED or FAILED
        self._lock = threading.Lock()

    def open(self, handoff: KVHandoff) -> None:
        with self._lock:
            if self.transfer_id and not hmac.compare_digest(handoff.transfer_id.encode(), self.transfer_id.encode()):
                raise KVRefused(f"request {self.request_id}: no transfer {handoff.transfer_id!r} was reserved",
                                reason="unknown_transfer")
            if self.source_endpoint and handoff.source_endpoint != self.source_endpoint:
                raise KVRefused(f"request {self.request_id}: KV expected from {self.source_endpoint}, the handoff "
                                f"comes from {handoff.source_endpoint or 'an unnamed sender'}", reason="wrong_source")
            if self.state is not ReservationState.RESERVED:
                raise KVRefused(f"request {self.request_id}: KV already {self.state.value}, refusing a transfer",
                                reason="unknown_transfer")
            if handoff.num_tokens != self.num_tokens or handoff.num_blocks > len(self.block_ids):
                raise KVRefused(
                    f"request {self.request_id}: reserved {self.num_tokens} tokens in {len(self.block_ids)} blocks, "
                    f"the handoff carries {handoff.num_tokens} tokens in {handoff.num_blocks} blocks",
                    reason="block_count",
                )
            if handoff.first_block != self.first_block:
                raise KVRefused(
                    f"request {self.request_id}: this worker holds the first {self.first_block} blocks, the handoff "
                    f"starts at block {handoff.first_block}", reason="block_count",
                )
            self._blocks = WireBlocks(self.caches, self.block_ids, handoff.wire, sender=False)
            self._wire_range = handoff.wire_indices
            self.state = ReservationState.RECEIVING

    def write_block(self, index: int, data: torch.Tensor, crc32c: int | None = None) -> None:
        """Wire block `index` of the handoff (a whole block at TP 1 → 1, else one rank's run of KV heads of one)."""
        with self._lock:
            if self.state is not ReservationState.RECEIVING:
                raise KVTransferError(f"request {self.request_id}: transfer is {self.state.value}, block dropped")
            if index not in self._wire_range:
                raise KVTransferError(f"request {self.request_id}: block {index} is not the handoff's to write")
            # data: [num_layers, 2, block_size, heads, head_dim] (int8: values ‖ scales as bytes); one strided copy
            # across the layers that also checks the CRC (of the scales too). On a mismatch the reserved block
            # holds junk until the failed handoff frees it.
            assert self._blocks is not None
            self._blocks.write_block(index, data, crc32c)
            self.num_bytes += data.numel() * data.element_size()

    def write_blocks(self, first_index: int, data: torch.Tensor) -> None:
        """Wire blocks first_index, ... of the handoff, all of `data` ([k, *wire_shape]) at once and unchecked:
        the transport verifies them (device digests) before it commits."""
        with self._lock:
            if self.state is not ReservationState.RECEIVING:
                raise KVTransferError(f"request {self.request_id}: transfer is {self.state.value}, blocks dropped")
            end = first_index + data.shape[0]
            if not (first_index in self._wire_range and end - 1 in self._wire_range):
                raise KVTransferError(f"request {self.request_id}: blocks {first_index} to {end - 1} are not the "
                                      "handoff's to write")
            assert self._blocks is not None
            self._blocks.write_blocks(first_index, data)
            self.num_bytes += data.numel() * data.element_size()

    def commit(self) -> None:
        with self._lock:
            if self.state is not ReservationState.RECEIVING:
                raise KVTransferError(f"request {self.request_id}: cannot commit a transfer that is {self.state.value}")
            self.state = ReservationState.COMMITTED
            self.done.set()

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.state in (ReservationState.RESERVED, ReservationState.RECEIVING):
                self.state = ReservationState.FAILED
                self.error = reason
                self.done.set()

    cancel = fail


class ReservationSink:
    """The KVSink of a receiving worker: a handoff is accepted only for a request (or a peer fetch) that reserved
    blocks for it."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self._reservations: dict[str, Reservation] = {}
        self._lock = threading.Lock()

    def add(self, reservation: Reservation) -> None:
        with self._lock:
            self._reservations[reservation.request_id] = reservation

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._reservations.pop(request_id, None)

    def open(self, handoff: KVHandoff) -> Reservation:
        handoff.check_receiver(self.layout)
        with self._lock:
            reservation = self._reservations.get(handoff.request_id)
        if reservation is None:
            raise KVRefused(f"no blocks are reserved for request {handoff.request_id} on this worker",
                            reason="unknown_transfer")
        reservation.open(handoff)
        return reservation
