"""The in-process transport's device digest check (kv_transfer/inproc_transport.py): what a GPU-to-GPU handoff
checks in place of a CRC-32C, so that its blocks never go through the host. The conformance suite's inproc-cuda
cases run the whole transport on a GPU; here the receiving side's check runs on CPU tensors (the digest itself:
tests/kv_transfer/test_device_digest.py)."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.inproc_transport import _Incoming, device_digest
from kv_transfer.layout import KVChecksumError, KVHandoff
from tests.kv_transfer.transfer_peer import RecordingSink


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
