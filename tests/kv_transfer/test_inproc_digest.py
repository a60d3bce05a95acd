"""The in-process transport's device digest (kv_transfer/inproc_transport.py): what a GPU-to-GPU handoff checks in
place of a CRC-32C, so that its blocks never go through the host. The conformance suite's inproc-cuda cases run
the whole transport on a GPU; here the digest's contract and the receiving side's check run on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.inproc_transport import _Incoming, device_digest
from kv_transfer.layout import KVChecksumError, KVHandoff
from tests.kv_transfer.transfer_peer import RecordingSink


def test_the_digest_changes_with_any_byte_and_with_a_swap() -> None:
    block = torch.randn(2, 2, 4, 3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    digest = device_digest(block)
    assert digest.dtype == torch.int64 and digest.dim() == 0
    assert torch.equal(digest, device_digest(block.clone()))
    raw = block.reshape(-1).view(torch.uint8)
    for position in (0, 1, raw.numel() // 2, raw.numel() - 1):
        flipped = raw.clone()
        flipped[position] ^= 0x01
        assert not torch.equal(device_digest(flipped), digest), position
    swapped = raw.clone()
    i, j = 3, 10
    assert swapped[i] != swapped[j]
    swapped[[i, j]] = swapped[[j, i]]
    assert not torch.equal(device_digest(swapped), digest)


def test_a_block_whose_digest_differs_is_refused_before_it_is_written() -> None:
    from tests.kv_transfer.test_transport_conformance import SMALL, make_handoff

    sink = RecordingSink(SMALL)
    handoff: KVHandoff = make_handoff(SMALL, SMALL.block_size * 3)
    incoming = _Incoming(handoff, sink.open(handoff))
    blocks = [torch.randn(SMALL.wire_shape, generator=torch.Generator().manual_seed(i)).to(torch.float32)
              for i in range(3)]
    incoming.write(0, blocks[0], device_digest(blocks[0]))
    with pytest.raises(KVChecksumError, match="block 1 failed its checksum .*in place of the CRC-32C"):
        incoming.write(1, blocks[1], device_digest(blocks[2]))
    dest = sink.only()
    assert dest.written == [0]


def test_many_digests_at_once_equal_one_at_a_time(monkeypatch) -> None:
    """`device_digests` (what the ipc transport checks a GPU handoff with) gives each block's `device_digest`,
    however its blocks are grouped."""
    from kv_transfer import inproc_transport

    blocks = torch.randn(7, 2, 4, 3, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    one_by_one = [int(device_digest(block)) for block in blocks]
    assert inproc_transport.device_digests(blocks).tolist() == one_by_one
    monkeypatch.setattr(inproc_transport, "DIGEST_GROUP_BYTES", 3 * blocks[0].numel() * 2)  # groups of 3, 3, 1
    assert inproc_transport.device_digests(blocks).tolist() == one_by_one
