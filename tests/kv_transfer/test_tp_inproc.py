"""The in-process handoff between engines of different tensor-parallel sizes: every receiver rank's reserved blocks
end up with the sender's heads, and only once every slice arrived does the destination commit; a corrupt slice, a
sender that stops, a refused layout or sink each fail the handoff, and every reserved block goes back to the pool."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
import torch

from engine.core.block_pool import BlockPool, KVBlock
from kv_transfer.base import TransferFault
from kv_transfer.layout import KVChecksumError, KVHandoff, KVLayout, KVLayoutMismatch, KVTransferError
from kv_transfer.tp_inproc import RankCachesDestination, RankCachesSource, TPReceiver, TPSender
from kv_transfer.tp_slices import RankCache
from tests.kv_transfer.test_tp_slices import _full_cache, _shard

MODEL = KVLayout(num_layers=2, num_kv_heads=8, head_dim=4, block_size=2, dtype="float32")
NUM_BLOCKS = 5  # the caches' (test_tp_slices'), and the receiver's pool
SENDER_BLOCKS = [3, 0, 4]  # a 5-token handoff's 3 blocks in the sender's caches


class PoolSink:
    """A decode engine of `layout`: reserves a handoff's blocks from a real block pool, over every rank's cache;
    commit keeps them (until `release`), fail frees them."""

    def __init__(self, layout: KVLayout, ranks: list[RankCache], *, refuse: bool = False) -> None:
        self.layout = layout
        self.ranks = ranks
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=False)
        self.refuse = refuse
        self.opened = 0
        self.outcomes: list[str] = []
        self.held: list[KVBlock] = []

    def open(self, handoff: KVHandoff) -> RankCachesDestination:
        self.opened += 1
        if self.refuse:
            raise KVTransferError("no room")
        blocks = self.pool.allocate(handoff.num_blocks)

        def on_commit() -> None:
            self.outcomes.append("committed")
            self.held.extend(blocks)

        def on_fail(reason: str) -> None:
            self.outcomes.append("failed")
            self.pool.free(blocks)

        return RankCachesDestination(self.ranks, [b.block_id for b in blocks], on_commit=on_commit, on_fail=on_fail)

    def release(self) -> None:
        self.pool.free(self.held)
        self.held = []


def _engines(a: int, b: int, kv_cache_dtype: str = "auto") -> tuple[RankCachesSource, PoolSink, torch.Tensor,
                                                                     torch.Tensor | None]:
    model = dataclasses.replace(MODEL, kv_cache_dtype=kv_cache_dtype)
    sender = dataclasses.replace(model, tensor_parallel_size=a)
    receiver = dataclasses.replace(model, tensor_parallel_size=b)
    values, scales = _full_cache(model, seed=a * 10 + b)
    source = RankCachesSource(layout=sender, ranks=_shard(sender, values, scales), block_ids=SENDER_BLOCKS)
    sink = PoolSink(receiver, _shard(receiver, torch.zeros_like(values),
                                     None if scales is None else torch.zeros_like(scales)))
    return source, sink, values, scales


@pytest.fixture
def endpoint() -> Iterator[str]:
    yield f"inproc-tp://{uuid.uuid4().hex}"


def _attach(sink: PoolSink, endpoint: str) -> TPReceiver:
    receiver = TPReceiver(sink)
    receiver.attach(endpoint)
    return receiver


def _handoff(source: RankCachesSource, num_tokens: int = 5) -> KVHandoff:
    return KVHandoff(request_id="req", transfer_id=uuid.uuid4().hex, num_tokens=num_tokens, layout=source.layout)


@pytest.mark.parametrize("a,b,kv_cache_dtype", [(2, 4, "auto"), (4, 2, "int8"), (8, 16, "auto"), (16, 1, "auto"),
                                                (1, 1, "int8")])
def test_handoff_between_tp_sizes_lands_every_head_then_commits(a: int, b: int, kv_cache_dtype: str,
                                                                endpoint: str) -> None:
    source, sink, values, scales = _engines(a, b, kv_cache_dtype)
    receiver = _attach(sink, endpoint)
    try:
        result = TPSender().send(_handoff(source), source, endpoint=endpoint, timeout_s=10.0)
    finally:
        receiver.close()
    assert sink.outcomes == ["committed"]
    copies = max(1, b // MODEL.num_kv_heads)  # receiver ranks holding each head
    assert result.num_bytes == 3 * copies * dataclasses.replace(sink.layout, tensor_parallel_size=1).block_bytes
    dst_blocks = [blk.block_id for blk in sink.held]
    for rank, cache in enumerate(sink.ranks):
        heads = sink.layout.kv_head_range(rank)
        for src, dst in zip(SENDER_BLOCKS, dst_blocks, strict=True):
            assert torch.equal(cache.kv_cache[:, :, dst].view(torch.uint8),
                               values[:, :, src, :, heads.start:heads.stop].view(torch.uint8))
            if scales is not None:
                assert cache.kv_scales is not None
                assert torch.equal(cache.kv_scales[:, :, dst], scales[:, :, src, heads.start:heads.stop])
    sink.release()
    assert sink.pool.num_used_blocks == 0


@pytest.mark.parametrize("fault,error", [(TransferFault(corrupt_block=1), KVChecksumError),
                                         (TransferFault(corrupt_block=2, corrupt_byte=-1), KVChecksumError),
                                         (TransferFault(stop_after_blocks=2), KVTransferError)])
def test_a_failed_handoff_never_commits_and_frees_every_block(fault: TransferFault, error: type[Exception],
                                                              endpoint: str) -> None:
    source, sink, _, _ = _engines(2, 4, "int8")  # corrupt_byte -1: the last scale of a slice
    receiver = _attach(sink, endpoint)
    try:
        with pytest.raises(error):
            TPSender(fault=fault).send(_handoff(source), source, endpoint=endpoint, timeout_s=10.0)
    finally:
        receiver.close()
    assert sink.outcomes == ["failed"]
    assert sink.pool.num_used_blocks == 0


def test_commit_waits_for_every_slice_of_every_rank(endpoint: str) -> None:
    source, sink, _, _ = _engines(2, 4)
    receiver = _attach(sink, endpoint)
    try:
        incoming = receiver.open(_handoff(source))
        slices = incoming.plan.slices
        for index in range(3):
            for slice_no, s in enumerate(slices):
                if (index, slice_no) == (2, len(slices) - 1):  # the last rank's last slice never comes
                    continue
                incoming.write(index, slice_no, *source.read_slice(s.sender_rank, index, s.sender_heads))
        with pytest.raises(KVTransferError, match="commit after 11 of 12 slices"):
            incoming.commit()
        data, crc = source.read_slice(slices[0].sender_rank, 0, slices[0].sender_heads)
        with pytest.raises(KVTransferError, match="arrived twice"):
            incoming.write(0, 0, data, crc)
        incoming.dest.fail("test")
        incoming.dest.fail("twice")  # settles once
    finally:
        receiver.close()
    assert sink.outcomes == ["failed"]
    assert sink.pool.num_used_blocks == 0


def test_another_models_layout_is_refused_before_the_sink_opens(endpoint: str) -> None:
    source, _, _, _ = _engines(2, 4)
    other = dataclasses.replace(MODEL, head_dim=8, tensor_parallel_size=4)
    sink = PoolSink(other, [])
    receiver = _attach(sink, endpoint)
    try:
        with pytest.raises(KVLayoutMismatch, match="differ in head_dim"):
            TPSender().send(_handoff(source), source, endpoint=endpoint, timeout_s=10.0)
    finally:
        receiver.close()
    assert sink.opened == 0 and sink.outcomes == []


def test_a_sink_refusal_reaches_the_sender(endpoint: str) -> None:
    source, sink, _, _ = _engines(4, 2)
    sink.refuse = True
    receiver = _attach(sink, endpoint)
    try:
        with pytest.raises(KVTransferError, match="no room"):
            TPSender().send(_handoff(source), source, endpoint=endpoint, timeout_s=10.0)
    finally:
        receiver.close()
    assert sink.opened == 1 and sink.outcomes == [] and sink.pool.num_used_blocks == 0
    with pytest.raises(KVTransferError, match="no in-process TP KV receiver"):
        TPSender().send(_handoff(source), source, endpoint=endpoint, timeout_s=10.0)
