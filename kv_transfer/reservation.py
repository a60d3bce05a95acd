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

import dataclasses
import enum
import hmac
import threading
from collections.abc import Callable, Sequence

import torch

from kv_transfer.layout import KVHandoff, KVLayout, KVRefused, KVTransferError
from kv_transfer.rank_lanes import Expect, RankLanes, Settled
from kv_transfer.tp_plan import wire_plan
from kv_transfer.tp_slices import LaneWrites, RankCache, WireBlocks, rank_caches


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
        ranks: Sequence[tuple[torch.Tensor, torch.Tensor | None]] | None = None, lanes: RankLanes | None = None,
    ) -> None:
        """`block_ids[:first_block]` are held already (this worker's prefix cache, shared with other requests):
        the handoff must skip them, and no write may touch them. `transfer_id` and `source_endpoint` ("": any)
        are what the one handoff it accepts must name. `kv_cache` / `kv_scales`: the runner's; at
        tensor_parallel_size N, `ranks` is every rank's (`KVBlocks.ranks`), the same block ids reserved on each
        (None where the children's caches are not mapped here: only lanes reach them then).

        The handoff arrives whole (one sender, every wire block), or as lanes (kv_transfer/rank_lanes.py): those to
        rank 0 open here, each once; those to child ranks at the children, which `lanes` (this worker's RankLanes, at
        TP > 1) tells to expect them and which report each lane settled. It commits once every lane of the plan
        committed; any lane failing fails it."""
        self.request_id = request_id
        self.transfer_id = transfer_id
        self.source_endpoint = source_endpoint
        self.num_tokens = num_tokens
        self.block_ids = block_ids
        self.first_block = first_block
        if ranks is None and layout.tensor_parallel_size > 1:
            own = RankCache(layout=layout, rank=0, kv_cache=kv_cache, kv_scales=kv_scales)
            self.caches: Sequence[RankCache | None] = [own] + [None] * (layout.tensor_parallel_size - 1)
        else:
            self.caches = rank_caches(layout, ranks or ((kv_cache, kv_scales),))
        self.layout = layout
        self._blocks: WireBlocks | None = None  # once open: the handoff's wire blocks in this worker's caches
        self._wire_range = range(0)  # the wire blocks the open handoff may write
        self.state = ReservationState.RESERVED
        self.error: str | None = None
        self.num_bytes = 0
        self.done = threading.Event()  # set on COMMITTED or FAILED
        self._lock = threading.Lock()
        self._lanes: dict[tuple[int, int], str] = {}  # lane → "receiving" | "committed" | "failed"
        self._all_lanes: frozenset[tuple[int, int]] | None = None  # the plan's, known at the first lane
        self._hub = lanes
        self._hub_ended = False  # the children were told to forget or cancel this reservation
        self._children_quiet = threading.Event()  # set once they were told (and answered a cancel)
        if lanes is not None:
            lanes.expect(Expect(transfer_id, request_id, tuple(block_ids), first_block, num_tokens, source_endpoint),
                         self._settled)

    def open(self, handoff: KVHandoff) -> Reservation | _LaneWrites:
        """The destination of `handoff`: this reservation for a whole handoff, a lane's for a lane."""
        if handoff.lane is not None:
            return self._open_lane(handoff)
        with self._lock:
            self._check_handoff(handoff)
            if self.state is not ReservationState.RESERVED:
                raise KVRefused(f"request {self.request_id}: KV already {self.state.value}, refusing a transfer",
                                reason="unknown_transfer")
            if any(cache is None for cache in self.caches):
                raise KVRefused(f"request {self.request_id}: this worker's ranks take their KV heads as lanes, each "
                                "at its own endpoint (decode_rank_endpoints), not as one handoff", reason="malformed")
            self._blocks = WireBlocks(self.caches, self.block_ids, handoff.wire, sender=False)
            self._wire_range = handoff.wire_indices
            self.state = ReservationState.RECEIVING
            return self

    def _check_handoff(self, handoff: KVHandoff) -> None:
        if self.transfer_id and not hmac.compare_digest(handoff.transfer_id.encode(), self.transfer_id.encode()):
            raise KVRefused(f"request {self.request_id}: no transfer {handoff.transfer_id!r} was reserved",
                            reason="unknown_transfer")
        handoff.check_reserved(request_id=self.request_id, source_endpoint=self.source_endpoint,
                               num_tokens=self.num_tokens, num_blocks=len(self.block_ids),
                               first_block=self.first_block)

    def _open_lane(self, handoff: KVHandoff) -> _LaneWrites:
        assert handoff.lane is not None
        with self._lock:
            self._check_handoff(handoff)
            if handoff.lane[1] != 0:
                raise KVRefused(f"request {self.request_id}: lane {handoff.lane} goes to receiver rank "
                                f"{handoff.lane[1]}'s own endpoint, not rank 0's", reason="malformed")
            if self.state not in (ReservationState.RESERVED, ReservationState.RECEIVING) or \
                    self._blocks is not None or handoff.lane in self._lanes:
                raise KVRefused(f"request {self.request_id}: KV {self.state.value}, refusing lane {handoff.lane}",
                                reason="unknown_transfer")
            self._plan_lanes(handoff.all_lanes)
            self._lanes[handoff.lane] = "receiving"
            self.state = ReservationState.RECEIVING
            return _LaneWrites(self, handoff, WireBlocks(self.caches, self.block_ids, handoff.wire, sender=False))

    def _plan_lanes(self, lanes: tuple[tuple[int, int], ...]) -> None:
        """The lanes that must all commit (under the lock): every lane must come from the same plan."""
        if self._all_lanes is None:
            self._all_lanes = frozenset(lanes)
        elif self._all_lanes != frozenset(lanes):
            raise KVRefused(f"request {self.request_id}: lanes of two different plans", reason="malformed")

    def _lane_committed(self, lane: tuple[int, int], num_bytes: int) -> None:
        """(under the lock) Lane `lane` committed; the reservation commits with the plan's last lane."""
        self._lanes[lane] = "committed"
        self.num_bytes += num_bytes
        if self._all_lanes is not None and all(self._lanes.get(x) == "committed" for x in self._all_lanes):
            self.state = ReservationState.COMMITTED
            self.done.set()

    def _settled(self, settled: Settled) -> None:
        """A child rank settled one of its lanes (on RankLanes' thread)."""
        if settled.error is not None:  # never waits here: other reservations' reports queue behind this one
            self.fail_later(f"lane {settled.lane}: {settled.error}" if settled.lane[0] >= 0 else settled.error)
            return
        with self._lock:
            if self.state not in (ReservationState.RESERVED, ReservationState.RECEIVING):
                return
            sender = dataclasses.replace(self.layout, tensor_parallel_size=settled.sender_tensor_parallel_size)
            try:
                self._plan_lanes(wire_plan(sender, self.layout).lanes)
            except KVTransferError as exc:
                why = str(exc)
            else:
                why = None
                self._lane_committed(settled.lane, settled.num_bytes)
            committed = self.state is ReservationState.COMMITTED
        if why is not None:
            self.fail_later(why)
        elif committed:
            self._end_children(wait=False)

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
            if self.state is not ReservationState.RECEIVING or self._blocks is None:
                raise KVTransferError(f"request {self.request_id}: cannot commit a transfer that is {self.state.value}")
            self.state = ReservationState.COMMITTED
            self.done.set()
        self._end_children(wait=False)

    @property
    def cancels_later(self) -> bool:
        """Whether cancelling it waits on child ranks (a round trip): callers on an asyncio loop use `fail_later`."""
        return self._hub is not None

    def fail(self, reason: str) -> None:
        """Fail it unless it committed; at TP > 1 fail its lanes on every child rank too. Once this returns no write
        into its blocks is in flight on any rank (so the owner may free them: `cancel`). Blocks for a round trip to
        the child ranks (a child that does not answer in time is stopped first: rank_lanes.RankLanes.cancel)."""
        if self._settle(reason):
            self._end_children(wait=True)

    cancel = fail

    def fail_later(self, reason: str, then: Callable[[], None] | None = None) -> None:
        """`fail` without waiting: `then()` runs once no rank writes into its blocks any more (at once where no child
        rank takes part; else on a thread of RankLanes')."""
        if self._settle(reason):
            self._end_children(wait=False, then=then)
        elif then is not None:
            then()

    def _settle(self, reason: str) -> bool:
        """FAILED unless settled; whether the child ranks take part (it did not commit, and it has them)."""
        with self._lock:
            if self.state in (ReservationState.RESERVED, ReservationState.RECEIVING):
                self.state = ReservationState.FAILED
                self.error = reason
                self.done.set()
            return self.state is not ReservationState.COMMITTED and self._hub is not None

    def end(self) -> None:
        """Its owner let go of it (`ReservationSink.remove`): the child ranks forget it (cancel it, uncommitted),
        unless they were told; never waits."""
        self._end_children(wait=False)

    def _end_children(self, *, wait: bool, then: Callable[[], None] | None = None) -> None:
        """Once: the child ranks forget a committed reservation (no answer awaited: every lane of theirs settled), or
        cancel any other (answered: then none of them writes into its blocks any more). `wait`: return only when
        they are quiet (whoever told them); else `then()` runs when they are."""
        with self._lock:
            first = self._hub is not None and not self._hub_ended
            if first:
                self._hub_ended = True
            committed = self.state is ReservationState.COMMITTED
        hub = self._hub
        if hub is None:
            if then is not None:
                then()
            return
        if not first:  # told already, maybe still being told on another thread
            if wait:
                self._children_quiet.wait()
            elif then is not None:
                threading.Thread(target=lambda: (self._children_quiet.wait(), then()), daemon=True).start()
            return
        if committed:
            hub.forget(self.transfer_id)
            self._quiet(then)
            return
        reason = self.error or "the reservation was let go"
        if wait:
            try:
                hub.cancel(self.transfer_id, reason)
            finally:
                self._quiet(then)
        else:
            hub.cancel_later(self.transfer_id, reason, lambda: self._quiet(then))

    def _quiet(self, then: Callable[[], None] | None) -> None:
        self._children_quiet.set()
        if then is not None:
            then()


class _LaneWrites(LaneWrites):
    """One lane's wire blocks into rank 0's cache (its receiver rank is 0), under the reservation's lock: its writes
    and transitions are atomic."""

    def __init__(self, reservation: Reservation, handoff: KVHandoff, blocks: WireBlocks) -> None:
        super().__init__(handoff, blocks, reservation._lock)  # noqa: SLF001
        self.reservation = reservation

    def refusal(self) -> str | None:
        r = self.reservation
        if r.state is not ReservationState.RECEIVING or r._lanes.get(self.lane) != "receiving":  # noqa: SLF001
            return f"request {r.request_id}: transfer is {r.state.value}, lane {self.lane}'s blocks dropped"
        return None

    def commit(self) -> None:
        r = self.reservation
        with r._lock:  # noqa: SLF001
            why = self.refusal()
            if why is not None:
                raise KVTransferError(f"cannot commit lane {self.lane}: {why}")
            r._lane_committed(self.lane, self.num_bytes)  # noqa: SLF001
            committed = r.state is ReservationState.COMMITTED
        if r._hub is not None:  # noqa: SLF001
            r._hub.count(0, received=self.num_bytes)  # noqa: SLF001
        if committed:
            r._end_children(wait=False)  # noqa: SLF001

    def fail(self, reason: str) -> None:
        self.reservation.fail_later(f"lane {self.lane}: {reason}")


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
            reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            reservation.end()

    def check(self, handoff: KVHandoff) -> None:
        """KVLayoutMismatch unless the reservation `handoff` names (else this worker) takes its layout: a peer fetch
        at tensor_parallel_size > 1 stages whole blocks, a layout of size 1 (worker/peer_fetch.py)."""
        with self._lock:
            reservation = self._reservations.get(handoff.request_id)
        handoff.check_receiver(self.layout if reservation is None else reservation.layout)

    def open(self, handoff: KVHandoff) -> Reservation | _LaneWrites:
        self.check(handoff)
        with self._lock:
            reservation = self._reservations.get(handoff.request_id)
        if reservation is None:
            raise KVRefused(f"no blocks are reserved for request {handoff.request_id} on this worker",
                            reason="unknown_transfer")
        return reservation.open(handoff)
