"""The ipc KV transport: a prefill and a decode worker on one host hand blocks over through memory they share,
never through a socket; control travels over gRPC.

    sender                                                   receiver (KVReceiver.IpcTransfer on the worker's server)
    ──────                                                   ────────
    gather the travelling blocks into the staging buffer,
    checksum them; the copies complete (one sync)
    IpcTransfer(descriptor, commit: the buffer, ─────gRPC───▶ check layout and device, sink.open(handoff) ─▶ dest;
                every block's checksum)                      map the buffer (once per buffer), verify and copy
                                                             each block into dest; dest.commit()
    ◀──────────────────────────────────────────────────────── KVTransferAck(ok) | ack(error, error_kind)

The control call after a sender's first handoff to a receiver goes through the receiver's doorbell instead of
gRPC (kv_transfer/ipc_doorbell.py: a Unix socket, the same messages, a thread at each end; the gRPC ack names it).

One unary call, made once the bytes are staged: a sender that stops or dies while staging has opened nothing on
the receiver, and a receiver that dies or stalls ends the call (UNAVAILABLE, or the deadline: the sender's
timeout). A receiver whose caller's deadline passed before its copy ended fails the handoff instead of committing
it.

The staging buffer is memory of the sender's process that the receiver maps:
- on CPU, an anonymous shared-memory file (memfd), which the receiver opens as /proc/<pid>/fd/<fd>;
- on a GPU, a CUDA allocation, which the receiver opens with CUDA IPC (torch's `_share_cuda_` handle). Between
  two processes on one GPU a block then moves device to device, twice (cache → staging on the sender's side,
  staging → cache on the receiver's), and no byte of it crosses to the host. Checksums are device digests
  there (kv_transfer/device_digest.py: one kernel over the handoff's blocks on each side) instead of host
  CRC-32Cs, and each side syncs with the device once: the sender when it reads its digests (its gather is then
  done), the receiver when it reads its own after queueing the scatter into its cache (see `_copy_out`). The block
  ids go to the device from pinned memory without a sync (kv_transfer.wire_block.block_index).

Both ends must be on the same host (in the same PID namespace: one pod, or one machine under Ray) and on the same
kind of device; across hosts use the grpc or torch transport. A receiver on the sender's own process (tests, one
process holding both workers) takes the buffer directly: CUDA cannot open its own process's IPC handles.

One handoff at a time per (sender, receiver) pair, since the pair's buffer is in use until the receiver acks
(which it does after its copies completed); pairs run concurrently. The pair's buffer grows to the largest
handoff up to KEEP_BYTES and is kept for the next one; a larger handoff stages through a one-off buffer that both
ends let go of after it. The receiver keeps a sender's kept buffer mapped while that sender lives: the mapping of
a sender process that exited (killed mid-handoff, restarted) would hold its memory for good, so a reaper thread
unmaps it within REAP_INTERVAL_S. (A first version sent the descriptor ahead on a stream, so that the receiver
opened the handoff while the sender staged it: the stream's thread handoffs cost ~1.7 ms a handoff on a 2-core
host, more than the overlap saved.)

Stages timed (kv_transfer/stage_clock.py). Sender: buffer (finding the pair's buffer), gather+crc (CPU: per block,
one pass), gather and digest (GPU: queued) and sync (GPU: its digests read back), rpc (the call, until the ack).
Receiver: open, map, crc+copy (CPU), digest, scatter and sync+check (GPU), commit.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from kv_transfer.base import (
    KVBlockSource,
    KVSink,
    SettleOnce,
    TransferFault,
    TransferResult,
    read_blocks,
    write_blocks,
    write_verified,
)
from kv_transfer.block_copy import gather_into
from kv_transfer.grpc_link import (
    SERVICE,
    ChannelSender,
    SettlingReceiver,
    ack_error,
    error_ack,
    refusal,
    rpc_error,
    with_source,
)
from kv_transfer.device_digest import device_digests, warm_up
from kv_transfer.ipc_doorbell import DoorbellClient, DoorbellServer, DoorbellUnreachable
from kv_transfer.layout import KVChecksumError, KVHandoff, KVLayout, KVRefused, KVTransferError, KVTransferTimeout
from kv_transfer.stage_clock import StageClock
from protos import kv_transfer_pb2
from protos.cluster_auth import OPEN, ClusterAuth

logger = logging.getLogger(__name__)

KEEP_BYTES = 128 << 20  # a pair's buffer grows up to this and is kept; a larger handoff uses a one-off buffer
MAX_MAPPED = 8  # buffers a receiver keeps mapped (least recently used dropped first)
REAP_INTERVAL_S = 1.0  # how often a receiver unmaps the buffers of sender processes that exited
# The receiver maps a sender's memfd read-only; torch warns that a tensor over it must not be written, and nothing
# here writes it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)

# Buffers of this process, by id, for a receiver in the same process (CUDA cannot open its own IPC handles).
_local_lock = threading.Lock()
_local: dict[str, torch.Tensor] = {}


def wire_blocks(buffer: torch.Tensor, layout: KVLayout, count: int) -> torch.Tensor:
    """[count, *layout.wire_shape] of `layout.wire_dtype`: the first `count` blocks of a uint8 staging buffer."""
    data = buffer[: count * layout.block_bytes].view(getattr(torch, layout.wire_dtype))
    return data.view(count, *layout.wire_shape)


class StagingBuffer:
    """`num_bytes` of this process's memory on `device` that a receiver on this host can map (`proto` says how)."""

    def __init__(self, num_bytes: int, device: torch.device, *, keep: bool) -> None:
        self.num_bytes = num_bytes
        self.device = device
        self.id = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.proto = kv_transfer_pb2.KVIpcBuffer(id=self.id, num_bytes=num_bytes, pid=os.getpid(), keep=keep)
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        if device.type == "cpu":
            self._fd = os.memfd_create("splitserve-kv", os.MFD_CLOEXEC)
            try:
                os.ftruncate(self._fd, num_bytes)
                self._mmap = mmap.mmap(self._fd, num_bytes)
            except BaseException:
                os.close(self._fd)
                raise
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self.proto.fd = self._fd
        elif device.type == "cuda":
            self.tensor = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            (cuda_device, handle, storage_bytes, storage_offset, ref_counter_handle, ref_counter_offset,
             event_handle, event_sync_required) = self.tensor.untyped_storage()._share_cuda_()
            self.proto.MergeFrom(kv_transfer_pb2.KVIpcBuffer(
                cuda_device=cuda_device, cuda_handle=handle, cuda_storage_bytes=storage_bytes,
                cuda_storage_offset=storage_offset, cuda_ref_counter_handle=ref_counter_handle,
                cuda_ref_counter_offset=ref_counter_offset, cuda_event_handle=event_handle or b"",
                cuda_event_sync_required=event_sync_required,
            ))
        else:
            raise KVTransferError(f"the ipc KV transport stages blocks on cpu or cuda, not {device.type}")
        with _local_lock:
            _local[self.id] = self.tensor

    @property
    def keep(self) -> bool:
        return self.proto.keep

    def close(self) -> None:
        """Let go of the buffer; a receiver that still maps it keeps its memory until it unmaps it."""
        with _local_lock:
            _local.pop(self.id, None)
        del self.tensor
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
                pass
            self._mmap = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def map_buffer(msg: kv_transfer_pb2.KVIpcBuffer, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a sender's staging buffer, of `msg.num_bytes`; KVTransferError when it cannot be
    mapped (another host, a process that exited, a different device type)."""
    if msg.pid == os.getpid():
        with _local_lock:
            tensor = _local.get(msg.id)
        if tensor is None:
            raise KVTransferError(f"ipc buffer {msg.id} of this process is gone")
        return tensor
    if device.type == "cpu":
        if msg.cuda_handle:
            raise KVRefused(f"ipc buffer {msg.id} is on a GPU; this receiver's blocks are on the CPU",
                            reason="malformed")
        path = f"/proc/{msg.pid}/fd/{msg.fd}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise KVTransferError(f"cannot open the sender's shared memory {path} ({exc.strerror}): the ipc KV "
                                  "transport needs both workers on one host, in one PID namespace") from None
        try:
            size = os.fstat(fd).st_size
            if size < msg.num_bytes:
                raise KVRefused(f"ipc buffer {msg.id}: {size} bytes mapped, {msg.num_bytes} declared",
                                reason="malformed")
            mapping = mmap.mmap(fd, msg.num_bytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return torch.frombuffer(mapping, dtype=torch.uint8)
    if not msg.cuda_handle:
        raise KVRefused(f"ipc buffer {msg.id} is on the CPU; this receiver's blocks are on {device}",
                        reason="malformed")
    torch.cuda._lazy_init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            msg.cuda_device, msg.cuda_handle, msg.cuda_storage_bytes, msg.cuda_storage_offset,
            msg.cuda_ref_counter_handle, msg.cuda_ref_counter_offset, msg.cuda_event_handle,
            msg.cuda_event_sync_required,
        )
    except RuntimeError as exc:
        raise KVTransferError(f"cannot open the sender's CUDA IPC buffer {msg.id} ({exc}): the ipc KV transport "
                              "needs both workers on one host, with the GPU visible to both") from None
    tensor = torch.empty(0, dtype=torch.uint8, device=storage.device)
    tensor.set_(storage, 0, (storage.nbytes(),), (1,))
    if tensor.numel() < msg.num_bytes:
        raise KVRefused(f"ipc buffer {msg.id}: {tensor.numel()} bytes mapped, {msg.num_bytes} declared",
                        reason="malformed")
    return tensor


def process_start(pid: int) -> str | None:
    """Process `pid`'s start time (clock ticks after boot, /proc/<pid>/stat), None when it exited: a pid the
    kernel hands to another process later comes with another start time."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie closed its files already


@dataclass(frozen=True)
class _Mapping:
    """A sender's buffer mapped in this process, and whose it is: `started` is its sender's `process_start` when
    it was mapped."""

    tensor: torch.Tensor
    pid: int
    started: str | None


# ── receiver ─────────────────────────────────────────────────────────────────────────────────────────────────


class Receiver(SettlingReceiver):
    """Serves KVReceiver.IpcTransfer on the worker's gRPC server; one handler thread per handoff in flight. Opening
    and closing destinations is the gRPC link's (every destination settled once; `close` fails open ones)."""

    name = "ipc"

    def __init__(self, sink: KVSink) -> None:
        super().__init__(sink)
        self.device = torch.device(sink.device)
        warm_up(self.device)  # the digest kernels compile now, not in the first handoff
        self._mapped_lock = threading.Lock()
        self._mapped: collections.OrderedDict[str, _Mapping] = collections.OrderedDict()
        self._stop_reaper = threading.Event()  # set by close()
        self._reaper: threading.Thread | None = None  # started with the first buffer of another process
        self._doorbell: DoorbellServer | None = None  # made by attach (serving)

    def attach(self, server: grpc.Server, endpoint: str) -> None:
        try:
            self._doorbell = DoorbellServer(self._ring)
        except OSError as exc:  # the handoffs then all go over gRPC
            logger.warning("ipc KV receiver: no doorbell (%s); every handoff's control goes over gRPC", exc)
        handlers = {
            "IpcTransfer": grpc.unary_unary_rpc_method_handler(
                self._serve,
                request_deserializer=kv_transfer_pb2.KVIpcHandoff.FromString,
                response_serializer=kv_transfer_pb2.KVTransferAck.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    def close(self) -> None:
        super().close()
        if self._doorbell is not None:
            self._doorbell.close()
        self._stop_reaper.set()
        with self._mapped_lock:
            self._mapped.clear()

    def drop_exited_senders(self) -> list[str]:
        """Unmap every buffer whose sender process exited (once no copy out of it is running); returns their ids.
        The reaper calls it every REAP_INTERVAL_S."""
        with self._mapped_lock:
            mapped = [(key, m.pid, m.started) for key, m in self._mapped.items()]
        gone = [key for key, pid, started in mapped if started is None or process_start(pid) != started]
        with self._mapped_lock:
            for key in gone:
                self._mapped.pop(key, None)
        return gone

    def _reap(self) -> None:
        while not self._stop_reaper.wait(REAP_INTERVAL_S):
            self.drop_exited_senders()

    def _serve(self, request: kv_transfer_pb2.KVIpcHandoff, context: grpc.ServicerContext
               ) -> kv_transfer_pb2.KVTransferAck:
        """IpcTransfer: the handoff, acked with this receiver's doorbell for the sender's next ones."""
        ack = self._handle(request, context.time_remaining)  # (a worker's aio server gives sync handlers no is_active)
        if self._doorbell is not None:
            ack.ipc_doorbell = self._doorbell.name
        return ack

    def _ring(self, request: kv_transfer_pb2.KVIpcHandoff, deadline_s: float) -> kv_transfer_pb2.KVTransferAck:
        """The doorbell's handler: the same handoff, its deadline the sender's."""
        return self._handle(request, lambda: deadline_s - time.monotonic())

    def _handle(self, request: kv_transfer_pb2.KVIpcHandoff, time_remaining: Callable[[], float | None]
                ) -> kv_transfer_pb2.KVTransferAck:
        clock = StageClock()
        try:
            if request.descriptor.ipc_device != self.device.type:
                raise KVTransferError(f"ipc transport device mismatch: the sender stages blocks on "
                                      f"{request.descriptor.ipc_device or 'an unnamed device'}, this receiver's "
                                      f"are on {self.device.type}")
            handoff = KVHandoff.from_proto(request.descriptor)
            if request.commit.transfer_id != handoff.transfer_id:
                raise KVRefused(f"handoff {handoff.transfer_id}: its commit names {request.commit.transfer_id!r}",
                                reason="malformed")
            dest = self.open(handoff)
        except Exception as exc:  # refused before any byte was read; the sink opened nothing (or refused)
            return self._refuse(exc)
        clock.lap("open")
        try:
            self._copy_out(handoff, dest, request.commit, clock)
            time_left_s = time_remaining()
            if time_left_s is not None and time_left_s <= 0:
                raise KVTransferError(f"handoff {handoff.transfer_id}: the sender's deadline passed before the copy "
                                      "ended")
            dest.commit()
            clock.lap("commit")
        except Exception as exc:
            dest.fail(f"ipc KV transfer {handoff.transfer_id} failed: {refusal(exc)}")
            self.note_failure(exc)
            self.stage_log.add(handoff.transfer_id, clock, ok=False)
            return error_ack(exc)
        finally:
            self.forget(dest)
        self.stage_log.add(handoff.transfer_id, clock, ok=True)
        return kv_transfer_pb2.KVTransferAck(ok=True, num_bytes=handoff.num_bytes)

    def _refuse(self, exc: Exception) -> kv_transfer_pb2.KVTransferAck:
        self.note_failure(exc)
        return error_ack(exc)

    def _copy_out(self, handoff: KVHandoff, dest: SettleOnce, commit: kv_transfer_pb2.KVCommit,
                  clock: StageClock) -> None:
        """Copy every travelling block from the sender's buffer into `dest`, verifying each: as it is copied on
        the CPU; on a GPU, one digest kernel over all of them and one scatter into the cache, then one host sync
        (reading the digests back, queued after the scatter, so the copy is complete too: the sender reuses its
        buffer once we ack). A destination that scatters (the decode worker's reservation) is written before the
        digests are compared; a mismatch fails the handoff, whose reserved blocks are then freed unread, as after
        the CPU's fused copy-and-check. Any other destination is verified first, then written block by block."""
        indices = handoff.wire_indices
        on_gpu = self.device.type != "cpu"
        checks = list(commit.device_digests if on_gpu else commit.crc32c)
        if len(checks) != len(indices):
            raise KVRefused(f"handoff {handoff.transfer_id}: {len(checks)} checksums for {len(indices)} blocks",
                            reason="malformed")
        if not indices:
            return
        buffer = commit.ipc_buffer
        if buffer.num_bytes < handoff.num_bytes:
            raise KVRefused(f"handoff {handoff.transfer_id}: {handoff.num_bytes} bytes travel in a buffer of "
                            f"{buffer.num_bytes}", reason="malformed")
        try:
            blocks = wire_blocks(self._map(buffer), handoff.wire_layout, len(indices))
            clock.lap("map")
            if not on_gpu:
                for slot, index in enumerate(indices):
                    write_verified(dest, handoff, index, blocks[slot], checks[slot])
                clock.lap("crc+copy")
                return
            digests = device_digests(blocks)
            clock.lap("digest")
            if dest.scatters:
                write_blocks(dest, indices.start, blocks)  # one scatter into the cache, before the one sync
                clock.lap("scatter")
                _check_digests(handoff, digests.tolist(), checks)
                clock.lap("sync+check")
                return
            _check_digests(handoff, digests.tolist(), checks)
            clock.lap("sync+check")
            write_blocks(dest, indices.start, blocks)  # block by block
            torch.cuda.current_stream(blocks.device).synchronize()
            clock.lap("write+sync")
        finally:
            if not buffer.keep:
                with self._mapped_lock:
                    self._mapped.pop(buffer.id, None)

    def _map(self, buffer: kv_transfer_pb2.KVIpcBuffer) -> torch.Tensor:
        """The sender's buffer, mapped on first use. A new kept buffer of a sender process replaces its older ones
        (it outgrew them); at most MAX_MAPPED stay mapped; those of a sender that exited go (`drop_exited_senders`)."""
        with self._mapped_lock:
            mapping = self._mapped.get(buffer.id)
            if mapping is not None:
                self._mapped.move_to_end(buffer.id)
                return mapping.tensor
        started = process_start(buffer.pid)  # before mapping: a sender that exits meanwhile is reaped
        tensor = map_buffer(buffer, self.device)
        with self._mapped_lock:
            if buffer.keep:
                for old in [key for key in self._mapped if key.startswith(f"{buffer.pid}-")]:
                    del self._mapped[old]
            self._mapped[buffer.id] = _Mapping(tensor=tensor, pid=buffer.pid, started=started)
            while len(self._mapped) > MAX_MAPPED:
                self._mapped.popitem(last=False)
            if self._reaper is None and buffer.pid != os.getpid() and not self._stop_reaper.is_set():
                self._reaper = threading.Thread(target=self._reap, name="ipc-kv-reaper", daemon=True)
                self._reaper.start()
        return tensor


def _check_digests(handoff: KVHandoff, found: list[int], expected: list[int]) -> None:
    for slot, (got, want) in enumerate(zip(found, expected)):
        if got != want:
            raise KVChecksumError(f"handoff {handoff.transfer_id}: block {handoff.wire_indices[slot]} failed its "
                                  "checksum (a device digest, in place of the CRC-32C: the block stayed on the GPU)")


# ── sender ───────────────────────────────────────────────────────────────────────────────────────────────────


@dataclass(eq=False)
class _Pair:
    """The sender's end towards one receiver: one handoff at a time through its kept buffer."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    buffer: StagingBuffer | None = None
    doorbell: DoorbellClient | None = None  # the receiver's, once a gRPC ack named it


class Sender(ChannelSender):
    """Stages each handoff in a buffer this process shares with the receiver's, on this host. Thread-safe."""

    name = "ipc"

    def __init__(self, *, worker_id: str, device: torch.device, fault: TransferFault | None = None,
                 auth: ClusterAuth = OPEN, doorbell: bool = True) -> None:
        """`doorbell`: ring the receivers' doorbells once known (False: every call over gRPC, bench/handoff_cost.py's
        baseline)."""
        super().__init__(worker_id=worker_id, device=device, fault=fault, auth=auth)
        self._use_doorbell = doorbell
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        warm_up(self.device)  # the digest kernels compile now, not in the first handoff
        self._lock = threading.Lock()
        self._pairs: dict[str, _Pair] = {}  # by receiver endpoint

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            with pair.lock:
                if pair.buffer is not None:
                    pair.buffer.close()
                    pair.buffer = None
                if pair.doorbell is not None:
                    pair.doorbell.close()
                    pair.doorbell = None
        super().close()

    def _pair(self, endpoint: str) -> _Pair:
        with self._lock:
            return self._pairs.setdefault(endpoint, _Pair())

    def send(self, handoff: KVHandoff, source: KVBlockSource, *, endpoint: str, timeout_s: float) -> TransferResult:
        start_s = time.monotonic()
        handoff = with_source(handoff, worker_id=self.worker_id, transport=self.name)
        what = f"KV handoff {handoff.transfer_id} ({handoff.num_bytes} bytes) to {endpoint}"
        pair = self._pair(endpoint)
        if not pair.lock.acquire(timeout=timeout_s):
            raise KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s waiting for the previous transfer")
        clock = StageClock()
        try:
            self._transfer(handoff, source, endpoint, pair, start_s + timeout_s, timeout_s, what, clock)
        finally:
            pair.lock.release()
        return TransferResult(num_bytes=handoff.num_bytes, seconds=time.monotonic() - start_s,
                              stages_s=clock.done().stages_s, marks_s=clock.marks_s)

    def _transfer(self, handoff: KVHandoff, source: KVBlockSource, endpoint: str, pair: _Pair, deadline_s: float,
                  timeout_s: float, what: str, clock: StageClock) -> None:
        """Stage the blocks, then make the one call; the caller holds the pair's lock, and nothing touches its
        buffer once this returns or raises."""
        descriptor = handoff.to_proto()
        descriptor.ipc_device = self.device.type
        buffer = None
        try:
            buffer = self._buffer(pair, handoff.num_bytes)
            clock.lap("buffer")
            commit = self._stage(handoff, source, buffer, deadline_s, timeout_s, what, clock)
            time_left_s = deadline_s - time.monotonic()
            if time_left_s <= 0:
                raise KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s")
            request = kv_transfer_pb2.KVIpcHandoff(descriptor=descriptor, commit=commit)
            clock.mark("call")
            ack = self._ring(pair, request, time_left_s, what, timeout_s)
            if ack is not None:
                clock.lap("ring")
            else:
                try:
                    ack = self._channels.stub(endpoint).IpcTransfer(request, timeout=time_left_s)
                    clock.lap("rpc")
                except grpc.RpcError as exc:
                    if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                        self._channels.forget(endpoint)
                    raise rpc_error(exc, what=what, endpoint=endpoint, timeout_s=timeout_s) from None
                if self._use_doorbell and ack.ipc_doorbell and (
                        pair.doorbell is None or pair.doorbell.name != ack.ipc_doorbell):
                    pair.doorbell = DoorbellClient(ack.ipc_doorbell)
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(f"{what}: {exc}") from exc
        finally:
            if buffer is not None and not buffer.keep:
                buffer.close()
        if not ack.ok:
            raise ack_error(ack, endpoint=endpoint)

    @staticmethod
    def _ring(pair: _Pair, request: kv_transfer_pb2.KVIpcHandoff, time_left_s: float, what: str, timeout_s: float
              ) -> kv_transfer_pb2.KVTransferAck | None:
        """The call through the receiver's doorbell; None when there is none, or it could not have been heard (the
        call then goes over gRPC). A doorbell that failed is forgotten."""
        if pair.doorbell is None:
            return None
        try:
            return pair.doorbell.call(request, time_left_s)
        except DoorbellUnreachable:
            pair.doorbell = None
            return None
        except TimeoutError:
            pair.doorbell = None
            raise KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s (waiting for the receiver's ack)") \
                from None
        except Exception as exc:
            pair.doorbell = None
            raise KVTransferError(f"{what}: the receiver's doorbell failed before it acked: {exc!r}") from exc

    def _buffer(self, pair: _Pair, num_bytes: int) -> StagingBuffer | None:
        """The buffer this handoff stages in: the pair's, grown if it is too small (up to KEEP_BYTES), or a one-off
        buffer for a larger handoff; None when no block travels."""
        if num_bytes == 0:
            return None
        if num_bytes > KEEP_BYTES:
            return StagingBuffer(num_bytes, self.device, keep=False)
        if pair.buffer is None or pair.buffer.num_bytes < num_bytes:
            grown = min(KEEP_BYTES, max(num_bytes, 2 * (pair.buffer.num_bytes if pair.buffer else 0)))
            if pair.buffer is not None:
                pair.buffer.close()
                pair.buffer = None
            pair.buffer = StagingBuffer(grown, self.device, keep=True)
        return pair.buffer

    def _stage(self, handoff: KVHandoff, source: KVBlockSource, buffer: StagingBuffer | None, deadline_s: float,
               timeout_s: float, what: str, clock: StageClock) -> kv_transfer_pb2.KVCommit:
        """Gather every travelling block into `buffer` and checksum it (CRC-32C on the CPU, a device digest on a
        GPU); returns the commit once the copies are complete."""
        commit = kv_transfer_pb2.KVCommit(transfer_id=handoff.transfer_id)
        indices = handoff.wire_indices
        if buffer is None:
            return commit
        commit.ipc_buffer.CopyFrom(buffer.proto)
        blocks = wire_blocks(buffer.tensor, handoff.wire_layout, len(indices))
        if self.device.type != "cpu":
            # On a GPU a kernel launch costs more than copying a block: one gather and one digest pass for all.
            stop = self.fault.stop_after_blocks
            if stop is not None and stop < len(indices):
                read_blocks(source, indices[:stop], blocks[:stop])
                raise KVTransferError(f"{what}: sender stopped after {stop} blocks (fault)")
            if time.monotonic() > deadline_s:
                raise KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s")
            read_blocks(source, indices, blocks)
            clock.lap("gather")
            digests = device_digests(blocks)
            self._corrupt(indices, blocks)
            clock.lap("digest")
            commit.device_digests.extend(digests.tolist())  # the one sync: the copies are done too
            clock.lap("sync")
            return commit
        for slot, index in enumerate(indices):  # on the CPU, each block's CRC-32C in the pass that copies it
            if slot == self.fault.stop_after_blocks:
                raise KVTransferError(f"{what}: sender stopped after {slot} blocks (fault)")
            if time.monotonic() > deadline_s:
                raise KVTransferTimeout(f"{what}: timed out after {timeout_s:.3g}s")
            commit.crc32c.append(gather_into(blocks[slot], source.read_block(index)))
            self._corrupt(range(index, index + 1), blocks[slot:slot + 1])
        clock.lap("gather+crc")
        return commit

    def _corrupt(self, indices: range, blocks: torch.Tensor) -> None:
        """The test fault's corruption, applied in the buffer after the checksums were taken."""
        for slot, index in enumerate(indices):
            wire = self.fault.apply(index, blocks[slot])
            if wire is not blocks[slot]:
                blocks[slot].copy_(wire)
