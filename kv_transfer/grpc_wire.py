"""The gRPC transport's bulk messages, encoded and decoded by hand in protobuf's own wire format.

`KVTransferMessage{chunk: KVBlockChunk}` carries the KV bytes. Through the generated classes every chunk's data
is copied four times on the sender (tensor → bytes → message → serialized) and twice on the receiver; that, not
the socket, bounded the transport's throughput. Here the sender writes one buffer (header, data, trailer) in one
pass that also computes the block's CRC-32C (kv_transfer.block_copy.frame; the checksum is a fixed32 after the
data, so the header can be written before it is known), and the receiver gets a `Chunk` whose `data` is a view
into the received message, checked and copied once into the cache.

A chunk carries a piece of one block, or a run of several whole blocks (`run_frame`): blocks smaller than a chunk
travel several to a message, each with its own CRC-32C in `block_crc32c` after the data, since every gRPC message
costs a fixed overhead (~0.35 ms on the 2-core CPU host, where 360 KiB messages moved at 0.75 GB/s and 1 MiB and
larger ones at 1.8-1.9 GB/s).

The bytes on the wire are exactly what `KVTransferMessage.SerializeToString()` would produce (a test checks), so
the .proto stays the contract and any protobuf implementation can talk to us. Messages the fast decoder does not
recognise (the descriptor, fields in another order or form) go through the generated parser.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from protos import kv_transfer_pb2

# KVTransferMessage.chunk is field 2; KVBlockChunk: block_index 1, offset 2, data 3, last 4, crc32c 5 (fixed32),
# block_crc32c 6 (repeated fixed32, packed: one length-delimited field).
_CHUNK_TAG = (2 << 3) | 2
_VARINT, _I32, _LEN = 0, 5, 2
_CRC_KEY = bytes([(5 << 3) | _I32])
_RUN_CRC_KEY = bytes([(6 << 3) | _LEN])
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(slots=True, frozen=True)
class Chunk:
    """One decoded KVBlockChunk; `data` may be a view into the message it came in."""

    block_index: int
    offset: int
    data: memoryview
    last: bool
    crc32c: int | None  # None when the chunk carries none (only a block's last chunk does)
    block_crc32c: tuple[int, ...] = ()  # a run of whole blocks: each one's CRC-32C; () for a piece of one block


@dataclass(slots=True, frozen=True)
class Malformed:
    """A message that is not protobuf at all: the receiver fails the handoff with `reason` (a deserializer that
    raised would end the call with an opaque INTERNAL instead)."""

    reason: str


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, value: int) -> bytes:
    """A varint field, omitted at its default (0) as proto3 serializers do."""
    return _varint((number << 3) | _VARINT) + _varint(value) if value else b""


def chunk_frame(*, block_index: int, offset: int, data_len: int, last: bool, crc32c: bool) -> tuple[bytes, bytes]:
    """The bytes around a chunk's data: `head ‖ data ‖ tail`, followed, when `crc32c`, by the checksum's 4 bytes
    (little-endian), is the serialized `KVTransferMessage{chunk}` whose crc32c field is set."""
    head = _field(1, block_index) + _field(2, offset)
    if data_len:
        head += _varint((3 << 3) | _LEN) + _varint(data_len)
    tail = _field(4, int(last)) + (_CRC_KEY if crc32c else b"")
    inner_len = len(head) + data_len + len(tail) + (4 if crc32c else 0)
    return _varint(_CHUNK_TAG) + _varint(inner_len) + head, tail


def run_frame(*, block_index: int, block_bytes: int, num_blocks: int) -> tuple[bytes, bytes]:
    """The bytes around a run of `num_blocks` whole blocks of `block_bytes` each: `head ‖ data ‖ tail`, followed by
    each block's CRC-32C (4 bytes, little-endian, in order), is the serialized `KVTransferMessage{chunk}` with
    block_crc32c set. One block is the single-block chunk of `chunk_frame` (its crc32c field), which every receiver
    reads; a receiver from before runs refuses a run as malformed."""
    data_len = block_bytes * num_blocks
    if num_blocks == 1:
        return chunk_frame(block_index=block_index, offset=0, data_len=data_len, last=True, crc32c=True)
    head = _field(1, block_index) + _varint((3 << 3) | _LEN) + _varint(data_len)
    tail = _field(4, 1) + _RUN_CRC_KEY + _varint(4 * num_blocks)
    inner_len = len(head) + data_len + len(tail) + 4 * num_blocks
    return _varint(_CHUNK_TAG) + _varint(inner_len) + head, tail


def encode_chunk(*, block_index: int, offset: int, data: memoryview | bytes, last: bool, crc32c: int | None) -> bytes:
    """`KVTransferMessage(chunk=KVBlockChunk(...)).SerializeToString()` (crc32c None: the field unset)."""
    head, tail = chunk_frame(block_index=block_index, offset=offset, data_len=len(data), last=last,
                             crc32c=crc32c is not None)
    checksum = b"" if crc32c is None else crc32c.to_bytes(4, "little")
    return b"".join((head, data, tail, checksum))


def encode_message(message: kv_transfer_pb2.KVTransferMessage) -> bytes:
    """The request serializer: bytes from `encode_chunk` pass through, messages are serialized."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fast_chunk(raw: bytes) -> Chunk | None:
    """The chunk in `raw` if it has exactly the canonical shape `encode_chunk` writes; else None."""
    buf = memoryview(raw)
    end = len(buf)
    if not end or buf[0] != _CHUNK_TAG:
        return None
    inner_len, pos = _read_varint(buf, 1, end)
    if pos + inner_len != end:
        return None
    fields = {1: 0, 2: 0, 4: 0}
    crc32c: int | None = None
    block_crc32c: tuple[int, ...] = ()
    data = buf[0:0]
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT and number in fields:
            fields[number], pos = _read_varint(buf, pos, end)
        elif wire_type == _LEN and number == 3:
            size, pos = _read_varint(buf, pos, end)
            if pos + size > end:
                raise ValueError("chunk data runs past the message")
            data, pos = buf[pos : pos + size], pos + size
        elif wire_type == _I32 and number == 5:
            if pos + 4 > end:
                raise ValueError("truncated fixed32")
            crc32c, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        elif wire_type == _LEN and number == 6 and not block_crc32c:
            size, pos = _read_varint(buf, pos, end)
            if pos + size > end or size % 4:
                raise ValueError("malformed packed fixed32")
            block_crc32c = tuple(buf[pos : pos + size].cast("I")) if _LITTLE_ENDIAN else tuple(
                int.from_bytes(buf[i : i + 4], "little") for i in range(pos, pos + size, 4))
            pos += size
        else:
            return None  # an unknown field, or one in an unusual form: let the generated parser decide
    return Chunk(block_index=fields[1], offset=fields[2], data=data, last=bool(fields[4]), crc32c=crc32c,
                 block_crc32c=block_crc32c)


def decode_message(raw: bytes) -> kv_transfer_pb2.KVTransferMessage | Chunk | Malformed:
    """The request deserializer: a `Chunk` for a chunk message, the parsed message otherwise."""
    try:
        chunk = _fast_chunk(raw)
        if chunk is not None:
            return chunk
        message = kv_transfer_pb2.KVTransferMessage.FromString(raw)
    except Exception as exc:  # noqa: BLE001 - reported to the handler as data, not raised inside gRPC
        return Malformed(f"undecodable KV transfer message: {exc}")
    if message.WhichOneof("kind") == "chunk":
        c = message.chunk
        return Chunk(block_index=c.block_index, offset=c.offset, data=memoryview(c.data), last=c.last,
                     crc32c=c.crc32c if c.HasField("crc32c") else None, block_crc32c=tuple(c.block_crc32c))
    return message
