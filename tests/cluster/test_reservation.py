"""The decode worker's KV destination: a block lands in its reserved slot of the paged cache only through the
checked copy, a bad checksum raises, and a failed reservation refuses later writes."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.reservation import Reservation, ReservationState
from kv_transfer.base import tensor_checksum
from kv_transfer.layout import KVChecksumError, KVHandoff, KVLayout, KVTransferError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def _reservation() -> tuple[Reservation, torch.Tensor]:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache = torch.zeros((3, 2, 6, 4, 2, 8))
    reservation = Reservation("r", num_tokens=8, block_ids=[4, 1], kv_cache=kv_cache, layout=LAYOUT)
    reservation.open(KVHandoff(request_id="r", transfer_id="t", num_tokens=8, layout=LAYOUT))
    return reservation, kv_cache


def test_a_verified_block_lands_in_its_reserved_slot() -> None:
    reservation, kv_cache = _reservation()
    block = torch.randn(LAYOUT.block_shape)
    reservation.write_block(0, block, tensor_checksum(block))
    assert torch.equal(kv_cache[:, :, 4], block) and reservation.num_bytes == LAYOUT.block_bytes
    assert not kv_cache[:, :, [0, 1, 2, 3, 5]].any()


def test_a_bad_checksum_raises_and_the_failed_reservation_takes_no_more_blocks() -> None:
    reservation, kv_cache = _reservation()
    block = torch.randn(LAYOUT.block_shape)
    with pytest.raises(KVChecksumError):
        reservation.write_block(1, block, tensor_checksum(block) ^ 1)
    assert reservation.num_bytes == 0
    reservation.fail("block 1 failed its CRC-32C check")  # what the receiver does next
    assert reservation.state is ReservationState.FAILED and reservation.done.is_set()
    with pytest.raises(KVTransferError, match="block dropped"):
        reservation.write_block(0, block, tensor_checksum(block))


def test_a_handoff_must_skip_exactly_the_blocks_held_here_and_never_writes_them() -> None:
    kv_cache = torch.zeros((3, 2, 6, 4, 2, 8))
    reservation = Reservation("r", num_tokens=8, block_ids=[4, 1], kv_cache=kv_cache, layout=LAYOUT, first_block=1)
    with pytest.raises(KVTransferError, match="holds the first 1 blocks, the handoff starts at block 0"):
        reservation.open(KVHandoff(request_id="r", transfer_id="t", num_tokens=8, layout=LAYOUT))
    reservation.open(KVHandoff(request_id="r", transfer_id="t", num_tokens=8, layout=LAYOUT, first_block=1))
    block = torch.randn(LAYOUT.block_shape)
    with pytest.raises(KVTransferError, match="block 0 is not the handoff's to write"):
        reservation.write_block(0, block, tensor_checksum(block))  # block 4: shared prefix cache
    reservation.write_block(1, block, tensor_checksum(block))
    assert torch.equal(kv_cache[:, :, 1], block) and not kv_cache[:, :, 4].any()


def test_blocks_written_at_once_land_in_their_reserved_slots_and_nowhere_else() -> None:
    """`write_blocks` (the ipc transport's GPU path: one scatter, verified by the transport before it commits)
    writes the handoff's blocks into their reserved slots, never a held one, and only while receiving."""
    kv_cache = torch.zeros((3, 2, 6, 4, 2, 8))
    reservation = Reservation("r", num_tokens=12, block_ids=[4, 1, 3], kv_cache=kv_cache, layout=LAYOUT,
                              first_block=1)
    reservation.open(KVHandoff(request_id="r", transfer_id="t", num_tokens=12, layout=LAYOUT, first_block=1))
    blocks = torch.randn(2, *LAYOUT.block_shape)
    with pytest.raises(KVTransferError, match="blocks 0 to 1 are not the handoff's to write"):
        reservation.write_blocks(0, blocks)  # block 4: shared prefix cache
    with pytest.raises(KVTransferError, match="blocks 2 to 3 are not the handoff's to write"):
        reservation.write_blocks(2, blocks)  # past the reservation
    reservation.write_blocks(1, blocks)
    assert torch.equal(kv_cache[:, :, 1], blocks[0]) and torch.equal(kv_cache[:, :, 3], blocks[1])
    assert not kv_cache[:, :, [0, 2, 4, 5]].any() and reservation.num_bytes == 2 * LAYOUT.block_bytes
    reservation.fail("the digests did not match")
    with pytest.raises(KVTransferError, match="blocks dropped"):
        reservation.write_blocks(1, blocks)
