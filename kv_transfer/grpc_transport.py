"""The gRPC KV transport: the block bytes ride inside one client-streaming call to the receiver's worker server.

    sender                                                 receiver (KVReceiver.Transfer on the worker's server)
    ──────                                                 ────────
    descriptor ──────────────────────────────────────────▶ check layout, sink.open(handoff) ─▶ dest
    blocks 0..k-1: one chunk (≤3 MiB), a CRC-32C each ────▶ verify each as it is stored
      (a block over 3 MiB: chunk … chunk(last, crc32c))      (a split block assembled first)
    …                                                      …
    half-close ──────────────────────────────────────────▶ every block arrived: dest.commit()
    ◀──────────────────────────────────────────────────── KVTransferAck(ok) | ack(error, error_kind)

Blocks travel as many to a message as fit in CHUNK_BYTES (each with its own CRC-32C; kv_transfer/grpc_wire.py),
since every gRPC message costs a fixed overhead. Between GPU workers the blocks are staged in host memory the
transport keeps: one gather and one device-to-host copy per message on the sender, checks into pinned memory, one
host-to-device copy per message and one scatter on the receiver (kv_transfer/grpc_staging.py); on the CPU a block is
gathered out of the cache, checksummed and framed in one pass, and checked as it is copied into the cache.

Stages timed (kv_transfer/stage_clock.py). Sender: open (until gRPC asks for the first block), gather+d2h queued
(GPU), d2h wait (GPU), gather+crc+frame (per message; on a GPU the gather was done: the copy from pinned memory
into the message), send (gRPC taking a message and asking for the next), ack (the last message to the receiver's
answer). Receiver: open (descriptor, layout, sink), receive (waiting for a message), crc+copy (per message), h2d
(GPU: queueing the upload), scatter+sync (GPU), commit.

Memory stays bounded on both ends: the sender frames one message when gRPC flow control asks for more (its GPU
staging holds the handoff), the receiver holds READ_AHEAD + 1 messages and one block's buffer (its GPU staging
the handoff). The call carries the sender's `timeout_s` as its deadline, so a sender that stalls or dies cancels the
call on the receiver (which fails the destination), and a receiver that stalls or dies ends the call on the sender
with DEADLINE_EXCEEDED or UNAVAILABLE.

The channels, the error mapping and the receiver's bookkeeping of open destinations are the gRPC link's, shared
with the ipc and torch transports (kv_transfer/grpc_link.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Generator, Iterator
from queue import Full, Queue
from typing import TypeVar

import grpc
import torch

from kv_transfer.base import KVBlockSource, KVSink, SettleOnce, TransferFault, TransferResult, write_verified
from kv_transfer.block_copy import frame, frame_blocks, gather
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
from kv_transfer.grpc_staging import ReceiveStaging, SendStaging, StagingPools
from kv_transfer.grpc_wire import Chunk, Malformed, chunk_frame, decode_message, run_frame
from kv_transfer.layout import KVHandoff, KVRefused, KVTransferError, KVTransferTimeout
from kv_transfer.stage_clock import StageClock
from kv_transfer.staging_pool import KEEP_BYTES
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.cluster_auth import OPEN, ClusterAuth

# Blocks go as many to a message as fit in this; a larger block is split (into runs of whole layers where it can be).
# Every message stays below gRPC's 4 MiB default limit. Blocks of real models are ~0.4-3 MiB (SmolLM2, 16 tokens of
# bf16: 360 KiB, 8 to a message; Llama-3-8B: 2 MiB) and go whole: a split block costs the receiver a copy more (it is
# assembled before it is written). SmolLM2's 1.4 MiB blocks of 32 tokens, 1 MiB chunks against 3 MiB: 0.38-0.43x
# against 0.46-0.49x of the raw socket (docs/benchmarks.md).
CHUNK_BYTES = 3 << 20
# A GPU handoff up to this size is staged whole (device and pinned memory on each end, kept for the next one); a
# larger one goes block by block through pageable host memory, as all did before staging, rather than hold that much
# more memory (kv_transfer/grpc_staging.py).
STAGE_MAX_BYTES = KEEP_BYTES
READ_AHEAD = 2  # messages the receiver pulls ahead of the one it is writing into the cache
READ_AHEAD_THREAD = "kv-grpc-read-ahead"  # the name of the thread that pulls them
STOP_SLACK_S = 5.0  # how long past its deadline the sender waits for gRPC to report the deadline itself
# A block that came in one chunk is viewed, not copied, out of the received message (read-only bytes) until the
# sink copies it into the cache; torch warns that such a tensor must not be written, which nothing here does.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)
T = TypeVar("T")


# ── receiver ─────────────────────────────────────────────────────────────────────────────────────────────────


def _read_ahead(messages: Iterator[T], depth: int) -> Generator[T, None, None]:
    """`messages`, pulled on a thread of its own up to `depth` ahead of the consumer.

    Python gRPC starts receiving a stream's next message only when the handler asks for it, and then copies it
    out of the socket's buffers on its own thread; without this, that copy and the handler's copy of the block into
    the cache take turns. A failure of the stream (the sender cancelled, the deadline) reaches the consumer in
    order, as the exception `next` raised. When the consumer stops early, the thread stops at its next message (or
    when gRPC ends the call, which ends the stream)."""
    queue: Queue[T | _StreamEnd | BaseException] = Queue(maxsize=depth)
    stopped = threading.Event()

    def put(item: T | _StreamEnd | BaseException) -> bool:
        while not stopped.is_set():
            try:
                queue.put(item, timeout=0.5)
                return True
            except Full:
                continue
        return False

    def pull() -> None:
        try:
            for message in messages:
                if not put(message):
                    return
            put(_StreamEnd())
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            put(exc)

    threading.Thread(target=pull, name=READ_AHEAD_THREAD, daemon=True).start()
    try:
        while True:
            item = queue.get()
            if isinstance(item, _StreamEnd):
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopped.set()


class _StreamEnd:
    """The marker `_read_ahead` queues after the last message."""


class _Servicer(kv_transfer_pb2_grpc.KVReceiverServicer):
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Transfer(
        self, request_iterator: Iterator[kv_transfer_pb2.KVTransferMessage | Chunk | Malformed],
        context: grpc.ServicerContext,
    ) -> kv_transfer_pb2.KVTransferAck:
        clock = StageClock()
        try:
            first = next(request_iterator)
        except StopIteration:
            return self._refuse(KVRefused("empty KV transfer stream", reason="malformed"))
        except grpc.RpcError:  # the sender went away before saying anything: nothing was opened
            return error_ack(KVTransferError("sender cancelled before the descriptor"))
        if not isinstance(first, kv_transfer_pb2.KVTransferMessage) or first.WhichOneof("kind") != "descriptor":
            return self._refuse(KVRefused("KV transfer stream must start with the handoff descriptor",
                                          reason="malformed"))
        try:
            handoff = KVHandoff.from_proto(first.descriptor)
            dest = self._receiver.open(handoff)
        except Exception as exc:  # refused before any byte was accepted; the sink opened nothing (or refused)
            return self._refuse(exc)
        clock.lap("open")
        messages = _read_ahead(request_iterator, READ_AHEAD)
        try:
            self._receiver.receive(handoff, dest, messages, clock)
            dest.commit()
            clock.lap("commit")
        except Exception as exc:  # a broken stream (grpc.RpcError on cancel or deadline) included
            reason = str(refusal(exc)) if not isinstance(exc, grpc.RpcError) else "sender cancelled or timed out"
            dest.fail(f"gRPC KV transfer {handoff.transfer_id} failed: {reason}")
            self._receiver.note_failure(exc)
            self._receiver.stage_log.add(handoff.transfer_id, clock, ok=False)
            return error_ack(exc if not isinstance(exc, grpc.RpcError) else KVTransferError(reason))
        finally:
            messages.close()  # stops the read-ahead thread now, not when the generator is collected
            self._receiver.forget(dest)
        self._receiver.stage_log.add(handoff.transfer_id, clock, ok=True)
        return kv_transfer_pb2.KVTransferAck(ok=True, num_bytes=handoff.num_bytes)

    def _refuse(self, exc: Exception) -> kv_transfer_pb2.KVTransferAck:
        self._receiver.note_failure(exc)
        return error_ack(exc)


class Receiver(SettlingReceiver):
    """Serves KVReceiver.Transfer on the worker's gRPC server; one handler thread per handoff in flight."""

    name = "grpc"

    def __init__(self, sink: KVSink) -> None:
        super().__init__(sink)
        device = torch.device(sink.device)
        # blocks bound for a GPU are staged in pinned and device memory kept from handoff to handoff
        self.staging = StagingPools(device) if device.type == "cuda" else None

    def attach(self, server: grpc.Server, endpoint: str) -> None:
        handlers = {
            "Transfer": grpc.stream_unary_rpc_method_handler(
                _Servicer(self).Transfer,
                request_deserializer=decode_message,
                response_serializer=kv_transfer_pb2.KVTransferAck.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    def close(self) -> None:
        super().close()
        if self.staging is not None:
            self.staging.clear()

    def receive(
        self, handoff: KVHandoff, dest: SettleOnce, messages: Iterator[kv_transfer_pb2.KVTransferMessage | Chunk],
        clock: StageClock,
    ) -> None:
        """Verify and store each block as it completes; raise on any gap. On the CPU a block is checked as it is
        copied into the cache, straight from the message (a split one assembled first); for a GPU it is checked as
        it is copied into pinned staging, the message's blocks are uploaded at once, and after the last message
        one scatter writes them all into the cache (kv_transfer/grpc_staging.py)."""
        if self.staging is None or not 0 < handoff.num_bytes <= STAGE_MAX_BYTES:
            self._receive(handoff, messages, clock, _DirectWrites(handoff, dest))
            return
        staging = ReceiveStaging(self.staging, handoff)
        try:
            self._receive(handoff, messages, clock, staging)
            staging.finish(dest)
            clock.lap("scatter+sync")
        finally:
            staging.close()

    def _receive(self, handoff: KVHandoff, messages: Iterator[kv_transfer_pb2.KVTransferMessage | Chunk],
                 clock: StageClock, store: _DirectWrites | ReceiveStaging) -> None:
        layout = handoff.wire_layout
        block_nbytes = layout.block_bytes
        buffer = bytearray(block_nbytes)  # a split block, assembled
        view = memoryview(buffer)
        index, filled = handoff.first_wire_block, 0
        for msg in messages:
            clock.lap("receive")
            if isinstance(msg, Malformed):
                raise KVRefused(f"handoff {handoff.transfer_id}: {msg.reason}", reason="malformed")
            if not isinstance(msg, Chunk):
                raise KVRefused(f"handoff {handoff.transfer_id}: a second descriptor in the stream", reason="malformed")
            if msg.block_crc32c:  # a run of whole blocks
                count = len(msg.block_crc32c)
                if (filled or msg.block_index != index or msg.offset or not msg.last or msg.crc32c is not None
                        or index + count > handoff.num_wire_blocks or len(msg.data) != count * block_nbytes):
                    raise KVRefused(
                        f"handoff {handoff.transfer_id}: a run of {count} blocks from block {msg.block_index} "
                        f"({len(msg.data)} bytes) where block {index} of {handoff.num_wire_blocks} was due",
                        reason="malformed",
                    )
                for slot, crc32c in enumerate(msg.block_crc32c):
                    store.verify(index + slot, msg.data[slot * block_nbytes:(slot + 1) * block_nbytes], crc32c)
                clock.lap("crc+copy")
                if isinstance(store, ReceiveStaging):
                    store.upload(range(index, index + count))
                    clock.lap("h2d")
                index += count
                continue
            if index >= handoff.num_wire_blocks or msg.block_index != index or msg.offset != filled:
                raise KVRefused(
                    f"handoff {handoff.transfer_id}: chunk of block {msg.block_index} at offset {msg.offset} "
                    f"out of order (expected block {index} at offset {filled} of {handoff.num_wire_blocks} blocks)",
                    reason="malformed",
                )
            end = filled + len(msg.data)
            if end > block_nbytes:
                raise KVRefused(f"handoff {handoff.transfer_id}: block {index} overflows {block_nbytes} bytes",
                                reason="malformed")
            if not msg.last:
                view[filled:end] = msg.data
                filled = end
                continue
            if end != block_nbytes:
                raise KVTransferError(
                    f"handoff {handoff.transfer_id}: block {index} ended at {end} of {block_nbytes} bytes"
                )
            if msg.crc32c is None:
                raise KVRefused(f"handoff {handoff.transfer_id}: block {index} came without its CRC-32C",
                                reason="malformed")
            if filled == 0:  # the whole block in one chunk: copied straight out of the message
                block = msg.data
            else:
                view[filled:end] = msg.data
                block = view
            store.verify(index, block, msg.crc32c)  # verified as it is copied (into the cache, or staging)
            clock.lap("crc+copy")
            if isinstance(store, ReceiveStaging):
                store.upload(range(index, index + 1))
                clock.lap("h2d")
            index, filled = index + 1, 0
        if index != handoff.num_wire_blocks or filled:
            raise KVTransferError(
                f"handoff {handoff.transfer_id}: stream ended at block {index} of {handoff.num_wire_blocks} "
                f"(blocks {handoff.first_wire_block} to {handoff.num_wire_blocks - 1} travel)"
            )


class _DirectWrites:
    """Blocks written into the destination one by one as they arrive, each checked as it is copied (the CPU)."""

    def __init__(self, handoff: KVHandoff, dest: SettleOnce) -> None:
        self.handoff = handoff
        self.dest = dest
        self.dtype = getattr(torch, handoff.wire_layout.wire_dtype)

    def verify(self, index: int, data: memoryview, crc32c: int) -> None:
        # [*layout.wire_shape], a view of the received bytes (or of the assembled block), copied out by the sink
        block = torch.frombuffer(data, dtype=self.dtype).view(self.handoff.wire_layout.wire_shape)
        write_verified(self.dest, self.handoff, index, block, crc32c)


# ── sender ───────────────────────────────────────────────────────────────────────────────────────────────────


class Sender(ChannelSender):
    """Streams each handoff in one call; one cached channel per receiver endpoint. Thread-safe."""

    name = "grpc"

    def __init__(self, *, worker_id: str, device: torch.device, fault: TransferFault | None = None,
                 auth: ClusterAuth = OPEN) -> None:
        super().__init__(worker_id=worker_id, device=device, fault=fault, auth=auth)
        # blocks on a GPU leave through device and pinned staging kept from handoff to handoff
        self.staging = StagingPools(self.device) if self.device.type == "cuda" else None

    def close(self) -> None:
        if self.staging is not None:
            self.staging.clear()
        super().close()

    def send(self, handoff: KVHandoff, source: KVBlockSource, *, endpoint: str, timeout_s: float) -> TransferResult:
        start_s = time.monotonic()
        clock = StageClock()
        handoff = with_source(handoff, worker_id=self.worker_id, transport=self.name)
        what = f"KV handoff {handoff.transfer_id} ({handoff.num_bytes} bytes)"
        gave_up: list[KVTransferError] = []

        def messages() -> Iterator[kv_transfer_pb2.KVTransferMessage | bytes]:
            yield kv_transfer_pb2.KVTransferMessage(descriptor=handoff.to_proto())
            clock.lap("open")
            try:
                # Framed here, on gRPC's thread, as gRPC asks for the next message. Framing a few blocks ahead
                # on a helper thread was measured slower: a thread wakeup costs more than it overlaps.
                for message in self._messages(handoff, source, clock, what):
                    yield message
                    clock.lap("send")
            except Exception as exc:
                # On a gRPC thread: end the stream short. A half-close, not a cancel, so that the receiver surely
                # sees the handoff open, then the stream end early, and fails it (a cancel could beat the
                # descriptor to the wire). A sender that truly dies drops the connection; the receiver fails then too.
                gave_up.append(exc if isinstance(exc, KVTransferError) else KVTransferError(f"{what}: {exc}"))

        stream = messages()
        clock.mark("call")
        call = self._channels.transfer(endpoint).future(stream, timeout=timeout_s)
        try:
            ack = call.result(timeout=timeout_s + STOP_SLACK_S)  # gRPC ends the call at timeout_s; this is a net
        except grpc.FutureTimeoutError:
            call.cancel()
            raise KVTransferTimeout(f"{what}: no answer from the receiver at {endpoint} after {timeout_s:.3g}s") from None
        except grpc.RpcError as exc:
            if gave_up:
                raise gave_up[0] from None
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._channels.forget(endpoint)
            raise rpc_error(exc, what=what, endpoint=endpoint, timeout_s=timeout_s) from None
        finally:
            # A stream gRPC left unfinished lets go of its staging now; one still running on gRPC's thread (a
            # ValueError here) does when that thread drops it, after its current message.
            with contextlib.suppress(ValueError):
                stream.close()
            del stream  # not kept alive by a traceback that holds this frame
        clock.lap("ack")
        if gave_up:
            raise gave_up[0]  # the receiver failed the handoff it saw cut short; our reason is the better one
        if not ack.ok:
            raise ack_error(ack, endpoint=endpoint)
        return TransferResult(num_bytes=handoff.num_bytes, seconds=time.monotonic() - start_s,
                              stages_s=clock.done().stages_s, marks_s=clock.marks_s)

    def _messages(self, handoff: KVHandoff, source: KVBlockSource, clock: StageClock, what: str
                  ) -> Iterator[bytes]:
        """The handoff's blocks as encoded KVTransferMessage chunks (kv_transfer.grpc_wire): runs of whole blocks up
        to CHUNK_BYTES a message, or the pieces of a block larger than that. From a CPU cache each block is
        gathered, checksummed and framed in one pass; from a GPU, the blocks are gathered once on the device and
        copied to pinned memory a message at a time (kv_transfer/grpc_staging.py), then checksummed and framed."""
        indices = handoff.wire_indices
        runs = _runs(len(indices), handoff.wire_layout.block_bytes, self.fault.stop_after_blocks)
        staging = None
        try:
            if self.staging is not None and 0 < handoff.num_bytes <= STAGE_MAX_BYTES:
                staging = SendStaging(self.staging, handoff.wire_layout, len(indices))
                staging.gather(source, indices)
                staging.copy_out(runs)
                clock.lap("gather+d2h queued")
            num_sent = 0
            for number, run in enumerate(runs):
                if num_sent == self.fault.stop_after_blocks:
                    raise KVTransferError(f"{what}: sender stopped after {num_sent} blocks (fault)")
                if staging is not None:
                    blocks = staging.host_blocks(number, run)
                    clock.lap("d2h wait")
                else:  # on the CPU (a GPU's handoff over STAGE_MAX_BYTES: block by block through the host)
                    blocks = [_on_host(source.read_block(indices[slot])) for slot in run]
                yield from self._frame_run(indices.start + run.start, blocks, clock)
                num_sent += len(run)
        finally:
            if staging is not None:
                staging.close()

    def _frame_run(self, first_index: int, blocks: list[torch.Tensor], clock: StageClock) -> Iterator[bytes]:
        """Blocks first_index, ... as messages: one run message (each block checksummed as it is copied in), or,
        for a block over CHUNK_BYTES, its pieces."""
        layout_bytes = blocks[0].numel() * blocks[0].element_size()
        if layout_bytes > CHUNK_BYTES:
            for slot, block in enumerate(blocks):
                chunks = self._frame_block(first_index + slot, block)
                clock.lap("gather+crc+frame")
                yield from chunks
            return
        head, tail = run_frame(block_index=first_index, block_bytes=layout_bytes, num_blocks=len(blocks))
        message, _ = frame_blocks(head, blocks, tail)
        corrupt = self.fault.corrupt_block
        if corrupt is not None and first_index <= corrupt < first_index + len(blocks):
            # flipped bytes go out under the true bytes' checksum: flip one in the framed message
            at = len(head) + (corrupt - first_index) * layout_bytes + self.fault.corrupt_byte % layout_bytes
            message = message[:at] + bytes([message[at] ^ 0xFF]) + message[at + 1:]
        clock.lap("gather+crc+frame")
        yield message

    def _frame_block(self, index: int, block: torch.Tensor) -> list[bytes]:
        """Block `index` (on the host) as encoded KVTransferMessage chunks (kv_transfer.grpc_wire), each made in one
        pass that gathers the block out of the source's cache, checksums it and frames it (kv_transfer.block_copy)."""
        num_bytes = block.numel() * block.element_size()
        true_crc32c = None
        if index == self.fault.corrupt_block:  # flipped bytes go out under the true bytes' checksum
            block, true_crc32c = gather(block)
            block = self.fault.apply(index, block)
        chunks, crc32c, offset = [], 0, 0
        for piece in _chunk_pieces(block, num_bytes, CHUNK_BYTES):
            end = offset + piece.numel() * piece.element_size()
            last = end == num_bytes
            head, tail = chunk_frame(block_index=index, offset=offset, data_len=end - offset, last=last, crc32c=last)
            message, crc32c = frame(head, piece, tail, crc32c=crc32c, append_crc=last)
            chunks.append(message)
            offset = end
        if true_crc32c is not None:
            chunks[-1] = chunks[-1][:-4] + true_crc32c.to_bytes(4, "little")  # the checksum is the last 4 bytes
        return chunks


def _on_host(block: torch.Tensor) -> torch.Tensor:
    return block if block.device.type == "cpu" else block.cpu()


def _runs(num_blocks: int, block_bytes: int, stop_after: int | None) -> list[range]:
    """The slots [0, num_blocks) in runs of up to CHUNK_BYTES // block_bytes (at least one) consecutive blocks, a
    message each; a run ends at `stop_after` too (the test fault that stops the sender there)."""
    per_run = max(1, CHUNK_BYTES // block_bytes)
    runs, start = [], 0
    while start < num_blocks:
        stop = min(start + per_run, num_blocks)
        if stop_after is not None and start < stop_after < stop:
            stop = stop_after
        runs.append(range(start, stop))
        start = stop
    return runs


def _chunk_pieces(block: torch.Tensor, num_bytes: int, chunk_bytes: int) -> list[torch.Tensor]:
    """`block` ([num_layers, ...], possibly a strided view of the paged cache; or an int8 block's bytes, where a
    "layer" is a byte) cut into pieces of at most `chunk_bytes` whose bytes, in order, are the block's: whole, when
    it fits in one chunk; else runs of whole layers (views, each gathered as it is framed, so the block is read
    once); else, when one layer alone is over a chunk, byte ranges of one contiguous copy."""
    if num_bytes <= chunk_bytes:
        return [block]
    layer_bytes = num_bytes // block.shape[0]
    if layer_bytes <= chunk_bytes:
        step = chunk_bytes // layer_bytes
        return [block[start:start + step] for start in range(0, block.shape[0], step)]
    flat = block.contiguous().view(-1).view(torch.uint8)
    return [flat[start:start + chunk_bytes] for start in range(0, num_bytes, chunk_bytes)]
