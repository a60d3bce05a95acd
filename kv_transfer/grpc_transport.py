"""The gRPC KV transport: the block bytes ride inside one client-streaming call to the receiver's worker server.

    sender                                                 receiver (KVReceiver.Transfer on the worker's server)
    ──────                                                 ────────
    descriptor ──────────────────────────────────────────▶ check layout, sink.open(handoff) ─▶ dest
    block 0: chunk(≤3 MiB) … chunk(last, crc32c) ─────────▶ (assemble a split block) write_block(0, data, crc32c)
    …                                                      …
    half-close ──────────────────────────────────────────▶ every block arrived: dest.commit()
    ◀──────────────────────────────────────────────────── KVTransferAck(ok) | ack(error, error_kind)

Memory stays bounded on both ends: the sender frames one block when gRPC flow control asks for more, the
receiver holds READ_AHEAD + 1 messages and one block's buffer. The call carries the sender's `timeout_s` as its
deadline, so a sender that stalls or dies cancels the call on the receiver (which fails the destination), and a
receiver that stalls or dies ends the call on the sender with DEADLINE_EXCEEDED or UNAVAILABLE.

The channels, the error mapping and the receiver's bookkeeping of open destinations are the gRPC link's, shared
with the ipc and torch transports (kv_transfer/grpc_link.py).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Generator, Iterator
from queue import Full, Queue
from typing import TypeVar

import grpc
import torch

from kv_transfer.base import KVBlockSource, SettleOnce, TransferResult, write_verified
from kv_transfer.block_copy import frame, gather
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
from kv_transfer.grpc_wire import Chunk, Malformed, chunk_frame, decode_message
from kv_transfer.layout import KVHandoff, KVRefused, KVTransferError, KVTransferTimeout
from kv_transfer.stage_clock import StageClock
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc

# A block larger than this is split (into runs of whole layers where it can be); every message stays below gRPC's
# 4 MiB default limit. Blocks of real models are ~1-3 MiB (Llama-3-8B, 16 tokens of bf16: 2 MiB) and go whole: a
# split block costs the receiver a copy more (it is assembled before it is written). SmolLM2's 1.4 MiB blocks of 32
# tokens, 1 MiB chunks against 3 MiB: 0.38-0.43x against 0.46-0.49x of the raw socket (docs/benchmarks.md).
CHUNK_BYTES = 3 << 20
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

    def attach(self, server: grpc.Server, endpoint: str) -> None:
        handlers = {
            "Transfer": grpc.stream_unary_rpc_method_handler(
                _Servicer(self).Transfer,
                request_deserializer=decode_message,
                response_serializer=kv_transfer_pb2.KVTransferAck.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    def receive(
        self, handoff: KVHandoff, dest: SettleOnce, messages: Iterator[kv_transfer_pb2.KVTransferMessage | Chunk],
        clock: StageClock,
    ) -> None:
        """Verify and write each block as its last chunk arrives; raise on any gap. A block that came whole in one
        chunk is checked and written straight from the message; a split one is assembled in one reused buffer."""
        layout = handoff.layout
        block_nbytes = layout.block_bytes
        dtype = getattr(torch, layout.wire_dtype)
        buffer = bytearray(block_nbytes)
        view = memoryview(buffer)
        # layout.wire_shape ([num_layers, 2, block_size, num_kv_heads, head_dim], or an int8 block's bytes),
        # sharing `buffer`: write_block copies it out
        assembled = torch.frombuffer(buffer, dtype=dtype).view(layout.wire_shape)
        index, filled = handoff.first_block, 0
        for msg in messages:
            clock.lap("receive")
            if isinstance(msg, Malformed):
                raise KVRefused(f"handoff {handoff.transfer_id}: {msg.reason}", reason="malformed")
            if not isinstance(msg, Chunk):
                raise KVRefused(f"handoff {handoff.transfer_id}: a second descriptor in the stream", reason="malformed")
            if index >= handoff.num_blocks or msg.block_index != index or msg.offset != filled:
                raise KVRefused(
                    f"handoff {handoff.transfer_id}: chunk of block {msg.block_index} at offset {msg.offset} "
                    f"out of order (expected block {index} at offset {filled} of {handoff.num_blocks} blocks)",
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
                block = torch.frombuffer(msg.data, dtype=dtype).view(layout.wire_shape)
            else:
                view[filled:end] = msg.data
                block = assembled
            write_verified(dest, handoff, index, block, msg.crc32c)  # verified as it is copied into the cache
            clock.lap("crc+copy")
            index, filled = index + 1, 0
        if index != handoff.num_blocks or filled:
            raise KVTransferError(
                f"handoff {handoff.transfer_id}: stream ended at block {index} of {handoff.num_blocks} "
                f"(blocks {handoff.first_block} to {handoff.num_blocks - 1} travel)"
            )


# ── sender ───────────────────────────────────────────────────────────────────────────────────────────────────


class Sender(ChannelSender):
    """Streams each handoff in one call; one cached channel per receiver endpoint. Thread-safe."""

    name = "grpc"

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
                for num_sent, index in enumerate(handoff.block_indices):
                    if num_sent == self.fault.stop_after_blocks:
                        raise KVTransferError(f"{what}: sender stopped after {num_sent} blocks (fault)")
                    # Framed here, on gRPC's thread, as gRPC asks for the next message. Framing a few blocks ahead
                    # on a helper thread was measured slower: a thread wakeup costs more than it overlaps.
                    for chunk in self._frame_block(index, source, clock):
                        yield chunk
                        clock.lap("send")
            except Exception as exc:
                # On a gRPC thread: end the stream short. A half-close, not a cancel, so that the receiver surely
                # sees the handoff open, then the stream end early, and fails it (a cancel could beat the
                # descriptor to the wire). A sender that truly dies drops the connection; the receiver fails then too.
                gave_up.append(exc if isinstance(exc, KVTransferError) else KVTransferError(f"{what}: {exc}"))

        clock.mark("call")
        call = self._channels.transfer(endpoint).future(messages(), timeout=timeout_s)
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
        clock.lap("ack")
        if gave_up:
            raise gave_up[0]  # the receiver failed the handoff it saw cut short; our reason is the better one
        if not ack.ok:
            raise ack_error(ack, endpoint=endpoint)
        return TransferResult(num_bytes=handoff.num_bytes, seconds=time.monotonic() - start_s,
                              stages_s=clock.done().stages_s, marks_s=clock.marks_s)

    def _frame_block(self, index: int, source: KVBlockSource, clock: StageClock) -> list[bytes]:
        """Block `index` as encoded KVTransferMessage chunks (kv_transfer.grpc_wire), each made in one pass that
        gathers the block out of the source's cache, checksums it and frames it (kv_transfer.block_copy)."""
        block = source.read_block(index)
        host = block if block.device.type == "cpu" else block.cpu()  # one device-to-host copy
        clock.lap("read" if host is block else "d2h")
        num_bytes = host.numel() * host.element_size()
        true_crc32c = None
        if index == self.fault.corrupt_block:  # flipped bytes go out under the true bytes' checksum
            host, true_crc32c = gather(host)
            host = self.fault.apply(index, host)
        chunks, crc32c, offset = [], 0, 0
        for piece in _chunk_pieces(host, num_bytes, CHUNK_BYTES):
            end = offset + piece.numel() * piece.element_size()
            last = end == num_bytes
            head, tail = chunk_frame(block_index=index, offset=offset, data_len=end - offset, last=last, crc32c=last)
            message, crc32c = frame(head, piece, tail, crc32c=crc32c, append_crc=last)
            chunks.append(message)
            offset = end
        if true_crc32c is not None:
            chunks[-1] = chunks[-1][:-4] + true_crc32c.to_bytes(4, "little")  # the checksum is the last 4 bytes
        clock.lap("gather+crc+frame")
        return chunks


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
