"""The torch.distributed KV transport: block bytes move point-to-point (gloo on CPU, NCCL between GPUs), control
travels over gRPC.

There is no world group: each (sender, receiver) pair makes its own 2-rank process group on demand, rendezvousing
through a TCPStore the receiver hosts, under a pair key the receiver hands out:

    sender (rank 0)                                            receiver (rank 1, hosts the TCPStore)
    ───────────────                                            ────────
    Open(descriptor, pair_key=held or "") ───gRPC───────────▶  check backend, layout; sink.open(handoff) ─▶ dest
                                                               reuse the group of that key, or make a new key;
    ◀──────────────────────────────────────────────────────── KVOpenAck(store_endpoint, pair_key)
    new key? build the group over PrefixStore(key, store)      (thread) build the group if new; recv every block
    send(block i, tag=i) for every block ─────gloo|NCCL─────▶           into a staging tensor
    Commit(wire_id, crc32c of every block) ──────gRPC────────▶  verify every block's CRC-32C, write_block each, commit
    ◀──────────────────────────────────────────────────────── KVTransferAck(ok) | ack(error, error_kind)

One transfer at a time per pair (a lock on each end); pairs run concurrently. The receiver learns the sender's
deadline from the Open call's gRPC deadline and fails the destination by then whatever happens; every wait on the
sender is bounded by its own deadline. After any failure both ends drop the pair's group: the sender asks for a
fresh key next time, and the receiver never reuses a group that failed. Groups a sender abandoned without failing
(it restarted) are dropped by the receiver after IDLE_GROUP_S.

The group itself (build, wait with a deadline, drop) is `kv_transfer.pair_group.PairGroup`.

Memory: the receiver stages a whole handoff in a buffer its pair reuses (its blocks' checksums arrive only with
Commit), then copies each block into its destination, verifying it in the same pass: a mismatch fails the
handoff, whose reserved blocks are freed unread. The sender gathers each block out of its cache and checksums it
in one pass (on the CPU; a GPU block is checksummed through a host copy).
"""

from __future__ import annotations

import datetime
import threading
import time
import secrets
from collections.abc import Callable
from typing import TypeVar

import grpc
import torch
import torch.distributed as dist

from kv_transfer.base import (
    KVBlockSource,
    KVReceiver,
    KVSink,
    SettleOnce,
    TransferFault,
    TransferResult,
    check_receivable,
    write_verified,
)
from kv_transfer.block_copy import gather
from kv_transfer.grpc_link import ChannelSender, ack_error, error_ack, refusal, rpc_error, with_source
from kv_transfer.layout import KVHandoff, KVTransferError, KVTransferTimeout, error_kind
from kv_transfer.pair_group import (
    WILDCARD_HOSTS,
    PairGroup,
    backend_for,
    grpc_peer_host,
    local_host_towards,
    remaining_s,
    split_host_port,
)
from kv_transfer.stage_clock import StageClock
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.cluster_auth import OPEN, ClusterAuth

DEFAULT_TIMEOUT_S = 60.0  # the receiver's deadline when a sender's Open carries none
IDLE_GROUP_S = 600.0  # the receiver drops a pair group unused this long (its sender restarted or left)

_Ack = TypeVar("_Ack", kv_transfer_pb2.KVOpenAck, kv_transfer_pb2.KVTransferAck)


# ── receiver ─────────────────────────────────────────────────────────────────────────────────────────────────


class _Incoming:
    """One handoff on the receiver, from Open to its ack; its thread is the only one that settles `dest`."""

    def __init__(self, handoff: KVHandoff, dest: SettleOnce, pair: PairGroup, deadline_s: float) -> None:
        self.handoff = handoff
        self.dest = dest
        self.pair = pair
        self.deadline_s = deadline_s
        self.checksums: list[int] | None = None
        self.commit_arrived = threading.Event()
        self.done = threading.Event()
        self.ack = kv_transfer_pb2.KVTransferAck(ok=False, error="handoff still in progress")


class _Servicer(kv_transfer_pb2_grpc.KVReceiverServicer):
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Open(self, request: kv_transfer_pb2.KVHandoffDescriptor, context: grpc.ServicerContext
             ) -> kv_transfer_pb2.KVOpenAck:
        return self._receiver.handle_open(request, context)

    def Commit(self, request: kv_transfer_pb2.KVCommit, context: grpc.ServicerContext) -> kv_transfer_pb2.KVTransferAck:
        return self._receiver.handle_commit(request, context)


class Receiver(KVReceiver):
    """Serves KVReceiver.Open / Commit on the worker's gRPC server and hosts the TCPStore its pairs meet in."""

    name = "torch"

    def __init__(self, sink: KVSink) -> None:
        super().__init__(sink)
        self.device = torch.device(sink.device)
        self.backend = backend_for(self.device)
        self._lock = threading.Lock()
        self._pairs: dict[str, PairGroup] = {}
        self._incoming: dict[str, _Incoming] = {}
        self._store: dist.TCPStore | None = None
        self._store_endpoint = ""
        self._closed = False

    def attach(self, server: grpc.Server, endpoint: str) -> None:
        """Start the pair-group store (on a free port, all interfaces) and add the servicer to `server`."""
        # The master store's own timeout bounds nothing of ours: every rendezvous uses a client with its deadline.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        host, _ = split_host_port(endpoint)
        # A wildcard listen address tells the sender nothing: it then uses the host it dialed for gRPC.
        advertised = "" if host in WILDCARD_HOSTS else host
        bracketed = f"[{advertised}]" if ":" in advertised else advertised
        self._store_endpoint = f"{bracketed}:{self._store.port}"
        kv_transfer_pb2_grpc.add_KVReceiverServicer_to_server(_Servicer(self), server)

    def close(self) -> None:
        """Refuse new handoffs, fail the ones in flight, drop idle groups (busy ones go when their transfer ends)."""
        with self._lock:
            self._closed = True
            incoming = list(self._incoming.values())
            idle = [pair for pair in self._pairs.values() if not pair.lock.locked()]
            self._pairs.clear()
        for item in incoming:
            item.dest.fail("KV receiver closed")
        for pair in idle:
            pair.drop()
        self._store = None

    # Open: validate, open the destination, pick the pair group, start the receiving thread.
    def handle_open(self, request: kv_transfer_pb2.KVHandoffDescriptor, context: grpc.ServicerContext
                    ) -> kv_transfer_pb2.KVOpenAck:
        time_left_s = context.time_remaining()
        deadline_s = time.monotonic() + (time_left_s if time_left_s is not None else DEFAULT_TIMEOUT_S)
        try:
            handoff = KVHandoff.from_proto(request)
            if request.torch_backend and request.torch_backend != self.backend:
                raise KVTransferError(
                    f"torch transport backend mismatch: sender uses {request.torch_backend}, "
                    f"receiver (device {self.device}) uses {self.backend}"
                )
            check_receivable(self.sink, handoff)
            with self._lock:
                if self._closed:
                    raise KVTransferError("KV receiver is closed")
            dest = SettleOnce(self.sink.open(handoff))
        except Exception as exc:  # refused before any byte moved; nothing opened
            self.note_failure(exc)
            err = refusal(exc)
            return kv_transfer_pb2.KVOpenAck(ok=False, error=str(err), error_kind=error_kind(err))
        pair = self._pair(request.pair_key)
        incoming = _Incoming(handoff, dest, pair, deadline_s)
        with self._lock:
            closed = self._closed  # closed while the sink was opening: this one was not there to be failed
            if not closed:
                self._forget_finished()
                self._incoming[handoff.wire_id] = incoming
        if closed:
            dest.fail("KV receiver closed")
            return kv_transfer_pb2.KVOpenAck(ok=False, error="KV receiver is closed")
        peer_host = grpc_peer_host(context.peer())
        threading.Thread(target=self._run, args=(incoming, peer_host), name=f"kv-recv-{handoff.transfer_id}",
                         daemon=True).start()
        return kv_transfer_pb2.KVOpenAck(ok=True, store_endpoint=self._store_endpoint, pair_key=pair.key)

    def _pair(self, key: str) -> PairGroup:
        """The group the sender holds, if we still have it intact; else a new one under a fresh key."""
        with self._lock:
            now_s = time.monotonic()
            for stale_key, stale in list(self._pairs.items()):
                if now_s - stale.last_used_s > IDLE_GROUP_S and not stale.lock.locked():
                    del self._pairs[stale_key]
                    stale.drop()
            pair = self._pairs.get(key)
            if pair is None or pair.broken:
                # Unguessable, and handed out only in the Open reply, which only a caller holding the cluster
                # secret gets: the peers that may join a pair group are those that presented it over gRPC.
                pair = PairGroup(f"kvpair-{secrets.token_hex(16)}", self.backend)
                self._pairs[pair.key] = pair
            pair.last_used_s = now_s
            return pair

    def _forget_finished(self) -> None:
        """Drop settled handoffs whose sender can no longer come for its ack (their deadline passed)."""
        now_s = time.monotonic()
        for transfer_id, item in list(self._incoming.items()):
            if item.done.is_set() and item.deadline_s < now_s:
                del self._incoming[transfer_id]

    def _run(self, item: _Incoming, peer_host: str) -> None:
        """Receive, wait for the checksums, verify, write, commit; fail the destination on any error or at the
        deadline. Holds the pair's lock throughout: the pair's staging buffer is in use until the handoff settles
        (the sender holds its end's lock until our ack, so this costs the pair nothing)."""
        handoff, dest, pair = item.handoff, item.dest, item.pair
        clock = StageClock()
        ok = False
        try:
            if not pair.lock.acquire(timeout=max(remaining_s(item.deadline_s), 0)):
                raise KVTransferError(f"handoff {handoff.transfer_id}: the pair's previous transfer did not end "
                                      "before the deadline")
            try:
                staging = self._receive(item, peer_host)
                clock.lap("receive")
                if not item.commit_arrived.wait(max(remaining_s(item.deadline_s), 0)):
                    raise KVTransferError(
                        f"handoff {handoff.transfer_id}: no Commit from the sender before the deadline"
                    )
                checksums = item.checksums or []
                indices = handoff.wire_indices
                if len(checksums) != len(indices):
                    raise KVTransferError(
                        f"handoff {handoff.transfer_id}: {len(checksums)} checksums for {len(indices)} blocks"
                    )
                clock.lap("commit wait")
                for slot, (index, expected) in enumerate(zip(indices, checksums)):  # each verified as it is copied
                    write_verified(dest, handoff, index, staging[slot], expected)
                clock.lap("crc+copy")
                dest.commit()
                clock.lap("commit")
            finally:
                pair.lock.release()
            item.ack = kv_transfer_pb2.KVTransferAck(ok=True, num_bytes=handoff.num_bytes)
            ok = True
        except Exception as exc:
            self.note_failure(exc)
            err = refusal(exc)
            dest.fail(f"torch KV transfer {handoff.transfer_id} failed: {err}")
            item.ack = kv_transfer_pb2.KVTransferAck(ok=False, error=str(err), error_kind=error_kind(err))
        finally:
            self.stage_log.add(handoff.transfer_id, clock, ok=ok)
            item.done.set()

    def _receive(self, item: _Incoming, peer_host: str) -> torch.Tensor:
        """Every block of the handoff into the pair's staging buffer, over its group (built here if new); the
        caller holds the pair's lock. Any failure drops the group for good."""
        handoff, pair = item.handoff, item.pair
        what = f"handoff {handoff.transfer_id}"
        try:
            if pair.broken:
                raise KVTransferError(f"{what}: the pair group was dropped")
            if pair.group is None:
                assert self._store is not None
                pair.build(store_host="127.0.0.1", store_port=self._store.port, rank=1,
                           local_host=local_host_towards(peer_host), device=self.device, deadline_s=item.deadline_s)
            staging = pair.staging_for(handoff, self.device)
            assert pair.group is not None
            # staging[slot] holds the slot-th block that travels (tag = slot)
            works = [pair.group.recv([staging[slot]], 0, slot) for slot in range(len(handoff.wire_indices))]
            for slot, work in enumerate(works):
                pair.wait(work, item.deadline_s, f"{what}: receiving block {handoff.first_wire_block + slot}")
            pair.last_used_s = time.monotonic()
            return staging
        except Exception as exc:
            with self._lock:
                self._pairs.pop(pair.key, None)
            pair.drop()
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"{what}: pair group failed: {exc}") from None

    # Commit: hand the checksums to the handoff's thread and answer with its outcome.
    def handle_commit(self, request: kv_transfer_pb2.KVCommit, context: grpc.ServicerContext
                      ) -> kv_transfer_pb2.KVTransferAck:
        with self._lock:
            item = self._incoming.get(request.transfer_id)
        if item is None:
            return error_ack(KVTransferError(f"commit of unknown handoff {request.transfer_id}"))
        item.checksums = list(request.crc32c)
        item.commit_arrived.set()
        time_left_s = context.time_remaining()
        wait_s = remaining_s(item.deadline_s) if time_left_s is None else time_left_s
        if not item.done.wait(max(wait_s, 0)):
            return error_ack(KVTransferError(f"handoff {request.transfer_id} still unsettled at the deadline"))
        with self._lock:
            self._incoming.pop(request.transfer_id, None)
        return item.ack


# ── sender ───────────────────────────────────────────────────────────────────────────────────────────────────


class Sender(ChannelSender):
    """One pair group per receiver endpoint, made on first use and after any failure. Thread-safe."""

    name = "torch"

    def __init__(self, *, worker_id: str, device: torch.device, fault: TransferFault | None = None,
                 auth: ClusterAuth = OPEN) -> None:
        super().__init__(worker_id=worker_id, device=device, fault=fault, auth=auth)
        self.backend = backend_for(self.device)
        self._lock = threading.Lock()
        self._pairs: dict[str, PairGroup] = {}  # by receiver endpoint

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.drop()
        super().close()

    def _pair(self, endpoint: str) -> PairGroup:
        with self._lock:
            pair = self._pairs.get(endpoint)
            if pair is None or pair.broken:
                pair = PairGroup("", self.backend)  # keyless until a receiver hands out a key
                self._pairs[endpoint] = pair
            return pair

    def send(self, handoff: KVHandoff, source: KVBlockSource, *, endpoint: str, timeout_s: float) -> TransferResult:
        start_s = time.monotonic()
        deadline_s = start_s + timeout_s
        handoff = with_source(handoff, worker_id=self.worker_id, transport=self.name)
        what = f"KV handoff {handoff.transfer_id} ({handoff.num_bytes} bytes) to {endpoint}"
        pair = self._pair(endpoint)
        if not pair.lock.acquire(timeout=timeout_s):
            raise KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s waiting for the previous transfer")
        try:
            clock = StageClock()
            used, checksums = self._transfer(handoff, source, endpoint, pair, deadline_s, timeout_s, what, clock)
            commit = kv_transfer_pb2.KVCommit(transfer_id=handoff.wire_id, crc32c=checksums)
            try:
                ack = self._call(lambda stub, t: stub.Commit(commit, timeout=t), endpoint, deadline_s, timeout_s, what)
                clock.lap("commit rpc")
            except KVTransferError:
                used.drop()  # the receiver may still be settling on this pair: start the next handoff on a new one
                raise
        finally:
            pair.lock.release()
        if not ack.ok:
            raise ack_error(ack, endpoint=endpoint)
        return TransferResult(num_bytes=handoff.num_bytes, seconds=time.monotonic() - start_s,
                              stages_s=clock.done().stages_s, marks_s=clock.marks_s)

    def _transfer(self, handoff: KVHandoff, source: KVBlockSource, endpoint: str, pair: PairGroup,
                  deadline_s: float, timeout_s: float, what: str, clock: StageClock) -> tuple[PairGroup, list[int]]:
        """Open, (re)build the group if the receiver handed out a new key, send every block. Returns the pair
        group used and the blocks' checksums."""
        descriptor = handoff.to_proto()
        descriptor.pair_key = pair.key
        descriptor.torch_backend = self.backend
        clock.mark("call")
        opened = self._call(lambda stub, t: stub.Open(descriptor, timeout=t), endpoint, deadline_s, timeout_s, what)
        clock.lap("open rpc")
        if not opened.ok:
            raise ack_error(opened, endpoint=endpoint)
        try:
            if opened.pair_key != pair.key or pair.group is None:
                pair = self._rebuild(endpoint, pair, opened, deadline_s)
            assert pair.group is not None
            checksums: list[int] = []
            in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # each tensor kept alive until its send ends
            for slot, index in enumerate(handoff.wire_indices):  # tag = slot, as the receiver's staging
                if slot == self.fault.stop_after_blocks:
                    for work, _ in in_flight:
                        pair.wait(work, deadline_s, f"{what}: sending")
                    raise KVTransferError(f"{what}: sender stopped after {slot} blocks (fault)")
                block, crc32c = gather(source.read_block(index))  # a strided view of the sender's cache
                checksums.append(crc32c)
                wire = self.fault.apply(index, block)
                clock.lap("gather+crc")
                in_flight.append((pair.group.send([wire], 1, slot), wire))
                clock.lap("send")
            for slot, (work, _) in enumerate(in_flight):
                pair.wait(work, deadline_s, f"{what}: sending block {handoff.first_wire_block + slot}")
            clock.lap("send wait")
            return pair, checksums
        except Exception as exc:
            pair.drop()  # the receiver sees the connection close and fails the handoff now, not at its deadline
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"{what}: {exc}") from None

    def _rebuild(self, endpoint: str, old: PairGroup, opened: kv_transfer_pb2.KVOpenAck, deadline_s: float
                 ) -> PairGroup:
        """Replace the endpoint's group by one under the receiver's new key (the old one, if any, is dropped).
        The caller holds `old.lock`; the new group takes over the endpoint and is used under that same lock."""
        old.drop()
        pair = PairGroup(opened.pair_key, self.backend)
        pair.lock = old.lock
        with self._lock:
            self._pairs[endpoint] = pair
        store_host, store_port = split_host_port(opened.store_endpoint)
        if store_host in WILDCARD_HOSTS:
            store_host, _ = split_host_port(endpoint)
        try:
            pair.build(store_host=store_host, store_port=store_port, rank=0,
                       local_host=local_host_towards(store_host), device=self.device, deadline_s=deadline_s)
        except Exception:
            pair.drop()  # half-built: never offer its key again
            raise
        return pair

    def _call(self, rpc: Callable[[kv_transfer_pb2_grpc.KVReceiverStub, float], _Ack], endpoint: str,
              deadline_s: float, timeout_s: float, what: str) -> _Ack:
        """One control call to the receiver, bounded by what is left of the handoff's deadline."""
        time_left_s = remaining_s(deadline_s)
        if time_left_s <= 0:
            raise KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s")
        try:
            return rpc(self._channels.stub(endpoint), time_left_s)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._channels.forget(endpoint)
            raise rpc_error(exc, what=what, endpoint=endpoint, timeout_s=timeout_s) from None
