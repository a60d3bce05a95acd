"""The gRPC transport's hand-made chunk encoding is protobuf's own: byte-identical to the generated serializer,
decoded the same as the generated parser (odd but valid encodings included), and garbage is reported, not raised;
the sender cuts a block over one chunk into pieces that hold its bytes in order."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from kv_transfer.grpc_link import TRANSFER_METHOD
from kv_transfer.grpc_transport import _chunk_pieces  # noqa: PLC2701 - the sender's chunking, checked directly
from kv_transfer.block_copy import frame, frame_blocks
from kv_transfer.grpc_wire import (
    Chunk,
    Malformed,
    chunk_frame,
    decode_message,
    encode_chunk,
    encode_message,
    run_frame,
)
from kv_transfer.grpc_wire import _varint  # noqa: PLC2701 - the same varint builds the odd encodings here
from kv_transfer.layout import KVHandoff, KVLayout, block_checksum
from kv_transfer.registry import make_receiver
from protos import kv_transfer_pb2
from tests.kv_transfer.transfer_peer import RecordingSink

CASES = [
    dict(block_index=0, offset=0, data=b"", last=False, crc32c=None),  # every field at its default
    dict(block_index=0, offset=0, data=b"x", last=True, crc32c=1),
    dict(block_index=0, offset=0, data=b"x", last=True, crc32c=0),  # a zero checksum is still sent
    dict(block_index=7, offset=1 << 20, data=os.urandom(1000), last=False, crc32c=None),
    dict(block_index=(1 << 32) - 1, offset=(1 << 64) - 1, data=os.urandom(300_000), last=True, crc32c=(1 << 32) - 1),
]


@pytest.mark.parametrize("fields", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
def test_encoding_is_byte_identical_to_protobuf(fields: dict, native: bool) -> None:
    kwargs = {k: v for k, v in fields.items() if v is not None}
    expected = kv_transfer_pb2.KVTransferMessage(chunk=kv_transfer_pb2.KVBlockChunk(**kwargs)).SerializeToString()
    assert encode_chunk(**{**fields, "data": memoryview(fields["data"])}) == expected
    # the sender's one-pass framing: header, data and trailer around the data, the checksum computed on the way
    head, tail = chunk_frame(block_index=fields["block_index"], offset=fields["offset"], data_len=len(fields["data"]),
                             last=fields["last"], crc32c=fields["crc32c"] is not None)
    data = torch.frombuffer(bytearray(fields["data"]) or bytearray(1), dtype=torch.uint8)[: len(fields["data"])]
    framed, crc = frame(head, data, tail, append_crc=fields["crc32c"] is not None, native=native)
    assert crc == block_checksum(fields["data"])
    with_crc = {**kwargs, "crc32c": crc} if fields["crc32c"] is not None else kwargs
    chunk = kv_transfer_pb2.KVBlockChunk(**with_crc)
    assert framed == kv_transfer_pb2.KVTransferMessage(chunk=chunk).SerializeToString()
    decoded = decode_message(expected)
    assert isinstance(decoded, Chunk)
    assert (decoded.block_index, decoded.offset, bytes(decoded.data), decoded.last, decoded.crc32c) == (
        fields["block_index"], fields["offset"], fields["data"], fields["last"], fields["crc32c"])


@pytest.mark.parametrize("num_blocks", [1, 2, 5])
@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
def test_a_run_of_blocks_is_protobufs_encoding_each_block_with_its_crc(num_blocks: int, native: bool) -> None:
    """Several whole blocks in one message, gathered out of a paged cache, each checksummed on the way: the bytes
    protobuf writes for KVBlockChunk{block_index, data, last, block_crc32c} (one block: its crc32c field, as before
    runs), decoded back to the same blocks and CRCs by the fast decoder and by the generated parser alike."""
    cache = torch.randn(2, 2, 8, 4, 3, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    blocks = [cache[:, :, i] for i in (5, 0, 7, 2, 3)[:num_blocks]]
    data = [block.contiguous().numpy().tobytes() for block in blocks]
    head, tail = run_frame(block_index=9, block_bytes=len(data[0]), num_blocks=num_blocks)
    framed, crcs = frame_blocks(head, blocks, tail, native=native)
    assert crcs == [block_checksum(d) for d in data]
    checksums = {"crc32c": crcs[0]} if num_blocks == 1 else {"block_crc32c": crcs}
    chunk = kv_transfer_pb2.KVBlockChunk(block_index=9, data=b"".join(data), last=True, **checksums)
    assert framed == kv_transfer_pb2.KVTransferMessage(chunk=chunk).SerializeToString()
    decoded = decode_message(framed)
    assert isinstance(decoded, Chunk)
    assert (decoded.block_index, bytes(decoded.data), decoded.last) == (9, b"".join(data), True)
    assert (decoded.crc32c, decoded.block_crc32c) == ((crcs[0], ()) if num_blocks == 1 else (None, tuple(crcs)))
    unpacked = kv_transfer_pb2.KVTransferMessage(chunk=chunk)  # the CRCs unpacked: valid, not our shape
    raw = bytearray(unpacked.SerializeToString())
    if num_blocks > 1:
        inner = (b"\x08\x09" + _varint((3 << 3) | 2) + _varint(len(chunk.data)) + chunk.data + b"\x20\x01"
                 + b"".join(bytes([(6 << 3) | 5]) + crc.to_bytes(4, "little") for crc in crcs))
        raw = bytearray(_varint((2 << 3) | 2) + _varint(len(inner)) + inner)
        assert kv_transfer_pb2.KVTransferMessage.FromString(bytes(raw)) == unpacked
    via_parser = decode_message(bytes(raw))
    assert isinstance(via_parser, Chunk) and via_parser.block_crc32c == decoded.block_crc32c


def test_valid_but_unusual_encodings_decode_as_protobuf_does() -> None:
    # Fields in reverse order, a zero written out explicitly, an unknown field: valid protobuf, not our shape.
    inner = (_varint((5 << 3) | 5) + (99).to_bytes(4, "little") + _varint(4 << 3) + _varint(1)
             + _varint((3 << 3) | 2) + _varint(3) + b"abc"
             + _varint(2 << 3) + _varint(0) + _varint(1 << 3) + _varint(4) + _varint(15 << 3) + _varint(1))
    raw = _varint((2 << 3) | 2) + _varint(len(inner)) + inner
    reference = kv_transfer_pb2.KVTransferMessage.FromString(raw).chunk
    decoded = decode_message(raw)
    assert isinstance(decoded, Chunk)
    assert (decoded.block_index, decoded.offset, bytes(decoded.data), decoded.last, decoded.crc32c) == (
        reference.block_index, reference.offset, reference.data, reference.last, reference.crc32c) == (4, 0, b"abc",
                                                                                                       True, 99)


def test_descriptor_passes_through_the_generated_classes() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    handoff = KVHandoff(request_id="r", transfer_id="t", num_tokens=9, layout=layout)
    message = kv_transfer_pb2.KVTransferMessage(descriptor=handoff.to_proto())
    decoded = decode_message(encode_message(message))
    assert isinstance(decoded, kv_transfer_pb2.KVTransferMessage) and decoded == message


@pytest.mark.parametrize("raw", [b"\x12\x05\x08", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x12\x80"])
def test_garbage_is_reported_not_raised(raw: bytes) -> None:
    assert isinstance(decode_message(raw), Malformed)


def _send_raw(messages: list[bytes]) -> tuple[kv_transfer_pb2.KVTransferAck, RecordingSink]:
    """A descriptor for 8 tokens (2 blocks), then `messages` as they are, to a real receiver; its ack and sink."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    sink = RecordingSink(layout)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    receiver = make_receiver("grpc", sink)
    receiver.attach(server, endpoint)
    server.start()
    try:
        handoff = KVHandoff(request_id="r", transfer_id=uuid.uuid4().hex, num_tokens=8, layout=layout)
        descriptor = kv_transfer_pb2.KVTransferMessage(descriptor=handoff.to_proto()).SerializeToString()
        with grpc.insecure_channel(endpoint) as channel:
            transfer = channel.stream_unary(TRANSFER_METHOD, request_serializer=lambda b: b,
                                            response_deserializer=kv_transfer_pb2.KVTransferAck.FromString)
            ack = transfer(iter([descriptor, *messages]), timeout=10)
    finally:
        receiver.close()
        server.stop(grace=None)
    sink.assert_each_settled_once()
    return ack, sink


def test_a_malformed_chunk_fails_the_handoff_with_a_clear_error() -> None:
    """A peer speaking garbage after a valid descriptor: the receiver fails the opened handoff and says why."""
    ack, sink = _send_raw([b"\x12\x80"])
    assert not ack.ok and "undecodable KV transfer message" in ack.error
    assert sink.only().outcome == "failed"


@pytest.mark.parametrize("data_blocks", [1, 3], ids=["short", "long"])
def test_a_run_whose_bytes_do_not_match_its_block_count_is_refused(data_blocks: int) -> None:
    """A run declaring 2 blocks' CRCs with another number of blocks' bytes: refused as malformed, nothing written."""
    block_bytes = 2 * 2 * 4 * 2 * 8 * 4  # one block of _send_raw's layout
    chunk = kv_transfer_pb2.KVBlockChunk(block_index=0, data=bytes(block_bytes * data_blocks), last=True,
                                         block_crc32c=[0, 0])
    ack, sink = _send_raw([kv_transfer_pb2.KVTransferMessage(chunk=chunk).SerializeToString()])
    assert not ack.ok and "a run of 2 blocks from block 0" in ack.error
    assert sink.only().outcome == "failed" and not sink.only().written


def test_a_block_without_its_checksum_fails_the_handoff() -> None:
    block = bytes(2 * 2 * 4 * 2 * 8 * 4)  # one block of the layout above
    ack, sink = _send_raw([encode_chunk(block_index=0, offset=0, data=block, last=True, crc32c=None)])
    assert not ack.ok and "block 0 came without its CRC-32C" in ack.error
    assert sink.only().outcome == "failed" and not sink.only().written


@pytest.mark.parametrize(
    ("layout", "num_pieces", "views"),
    [
        pytest.param(KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32"), 1, True,
                     id="720KiB-whole"),
        pytest.param(KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype="float32"), 2, True,
                     id="1.4MiB-runs-of-21-layers"),
        pytest.param(KVLayout(num_layers=3, num_kv_heads=4, head_dim=64, block_size=1024, dtype="bfloat16"), 3, True,
                     id="3MiB-a-layer-a-chunk"),
        pytest.param(KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=1100, dtype="float32"), 5, False,
                     id="4.3MiB-layers-over-a-chunk"),
    ],
)
def test_a_block_is_cut_into_chunks_that_hold_its_bytes_in_order(layout: KVLayout, num_pieces: int,
                                                                   views: bool) -> None:
    """The sender's chunks of a block read from the paged cache (here of at most 1 MiB): within the limit, their
    bytes in order the block's; views of the cache (gathered once, as each is framed) unless one layer alone is over
    a chunk."""
    chunk_bytes = 1 << 20
    num_blocks = 3
    cache = torch.randn((layout.num_layers, 2, num_blocks, *layout.block_shape[2:])).to(getattr(torch, layout.dtype))
    block = cache[:, :, 1]  # a strided view across the layers, as the prefill worker hands it
    pieces = _chunk_pieces(block, layout.block_bytes, chunk_bytes)
    assert len(pieces) == num_pieces
    assert all(p.numel() * p.element_size() <= chunk_bytes for p in pieces)
    assert all(p.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr() for p in pieces) == views
    expected = block.contiguous().view(-1).view(torch.uint8)
    assert torch.equal(torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in pieces]), expected)
