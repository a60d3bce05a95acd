"""The gRPC transport's staged path (kv_transfer/grpc_staging.py), which GPU workers take: one gather, a copy out per
message through kept host memory, blocks checked into host staging, uploaded, then scattered at once. Here both
ends are made to stage on the CPU (the same code; the copies are then synchronous), so that its logic runs without
a GPU; the conformance suite's grpc-cuda cases and the gpu-marked test below run it on one. Every test ends with
every staging lease given back and every reserved block free or committed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from kv_transfer.base import TransferFault
from kv_transfer.grpc_staging import StagingPools
from kv_transfer.grpc_transport import CHUNK_BYTES, _runs  # noqa: PLC2701 - the sender's message plan
from kv_transfer.layout import KVChecksumError, KVLayout, KVTransferError
from kv_transfer.registry import make_sender
from tests.kv_transfer.test_transport_conformance import INT8, SMALL_BF16, SMOLLM2, SPLIT_BY_BYTES
from tests.kv_transfer.transfer_peer import PatternSource, RecordingSink, make_handoff, serve_receiver

HAS_CUDA = torch.cuda.is_available()


class Staged:
    """A grpc receiver over a recording sink and a grpc sender, both staging on `device`."""

    def __init__(self, layout: KVLayout, device: str = "cpu", **sink_kwargs) -> None:
        self.device = torch.device(device)
        self.sink = RecordingSink(layout, device=device, **sink_kwargs)
        self.server, self.endpoint, self.receiver = serve_receiver("grpc", self.sink)
        self.sender = make_sender("grpc", worker_id="prefill-0", device=self.device)
        if self.device.type == "cpu":  # a GPU's ends stage by themselves
            self.receiver.staging = StagingPools(self.device)
            self.sender.staging = StagingPools(self.device)
        self.pools = [self.sender.staging, self.receiver.staging]

    def send(self, num_tokens: int, *, first_block: int = 0, seed: int = 0, fault: TransferFault | None = None,
             timeout_s: float = 30) -> PatternSource:
        handoff = dataclasses.replace(make_handoff(self.sink.layout, num_tokens), first_block=first_block)
        source = PatternSource(self.sink.layout, handoff.num_blocks, seed=seed, device=self.device)
        self.sender.fault = fault or TransferFault()
        self.sender.send(handoff, source, endpoint=self.endpoint, timeout_s=timeout_s)
        return source

    def allocated(self) -> list[int]:
        return [pool.num_allocated for pools in self.pools for pool in (pools.pinned, pools.on_device)]

    def leased(self, wait_s: float = 5.0) -> int:
        """Staging buffers leased, once none is (within `wait_s`: a stream the receiver cut short lets go of its
        buffers when gRPC's thread drops it, just after the call ended)."""
        deadline_s = time.monotonic() + wait_s
        while True:
            leased = sum(pool.num_leased for pools in self.pools for pool in (pools.pinned, pools.on_device))
            if not leased or time.monotonic() > deadline_s:
                return leased
            time.sleep(0.01)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.server.stop(grace=None)


@pytest.fixture
def staged() -> Iterator:
    made: list[Staged] = []

    def make(layout: KVLayout, device: str = "cpu", **sink_kwargs) -> Staged:
        made.append(Staged(layout, device, **sink_kwargs))
        return made[-1]

    yield make
    for ends in made:
        ends.close()
    for ends in made:
        ends.sink.assert_each_settled_once()
        assert ends.leased() == 0, "a staging buffer is still leased"
        held = sum(len(d.slots) for d in ends.sink.destinations if d.outcome == "committed")
        assert ends.sink.num_used == held  # only committed handoffs hold blocks


def test_blocks_go_several_to_a_message_a_run_ending_where_the_fault_stops() -> None:
    assert CHUNK_BYTES // SMOLLM2.block_bytes == 4  # 720 KiB blocks: 4 to a 3 MiB message
    assert _runs(10, SMOLLM2.block_bytes, None) == [range(0, 4), range(4, 8), range(8, 10)]
    assert _runs(10, SMOLLM2.block_bytes, 6) == [range(0, 4), range(4, 6), range(6, 10)]
    assert _runs(3, SPLIT_BY_BYTES.block_bytes, None) == [range(0, 1), range(1, 2), range(2, 3)]  # each split


@pytest.mark.parametrize(
    ("layout", "num_tokens", "first_block", "scatters"),
    [
        pytest.param(SMALL_BF16, 4 * 9 + 1, 2, True, id="bf16-held-head-one-run-scattered"),
        pytest.param(SMOLLM2, 16 * 9 + 5, 0, False, id="smollm2-3-runs-block-by-block"),
        pytest.param(SPLIT_BY_BYTES, 1600 + 7, 0, True, id="split-blocks"),
        pytest.param(INT8, 4 * 3 + 1, 1, True, id="int8"),
    ],
)
def test_a_staged_round_trip_is_byte_exact(staged, layout: KVLayout, num_tokens: int, first_block: int,
                                           scatters: bool) -> None:
    ends = staged(layout, scatters=scatters)
    source = ends.send(num_tokens, first_block=first_block)
    dest = ends.sink.only()
    assert dest.outcome == "committed"
    assert dest.written == list(range(first_block, dest.handoff.num_blocks))
    assert dest.scatters == int(scatters)  # a scattering destination: one write_blocks for the whole handoff
    assert torch.equal(dest.blocks()[first_block:].view(torch.uint8), source.blocks[first_block:].view(torch.uint8))
    assert not dest.blocks()[:first_block].view(torch.uint8).any()
    if layout.quantized:
        assert torch.equal(dest.block_scales()[first_block:], source.scales[first_block:])


def test_a_second_handoff_allocates_no_staging_and_a_larger_one_grows_it_once(staged) -> None:
    ends = staged(SMOLLM2)
    ends.send(16 * 6)
    first = ends.allocated()
    assert first == [1, 1, 1, 1]  # host and device staging, on each end
    ends.send(16 * 6, seed=1)
    ends.send(16 * 3, seed=2)  # smaller: the same buffers
    assert ends.allocated() == first
    ends.send(16 * 12, seed=3)  # larger: each buffer grows, once
    assert ends.allocated() == [2, 2, 2, 2]
    ends.send(16 * 12, seed=4)
    assert ends.allocated() == [2, 2, 2, 2]
    assert [d.outcome for d in ends.sink.destinations] == ["committed"] * 5


@pytest.mark.parametrize("scatters", [False, True], ids=["block-by-block", "scattered"])
def test_a_corrupted_block_of_a_run_fails_the_handoff_before_any_block_reaches_the_cache(staged, scatters) -> None:
    ends = staged(SMOLLM2, scatters=scatters)
    with pytest.raises(KVChecksumError, match="block 1"):
        ends.send(16 * 6, fault=TransferFault(corrupt_block=1, corrupt_byte=12345))
    dest = ends.sink.only()
    assert dest.outcome == "failed" and "CRC" in dest.fail_reasons[0]
    assert dest.written == [] and not ends.sink.cache.view(torch.uint8).any()  # checked in staging, never uploaded
    assert ends.sink.num_used == 0 and ends.leased() == 0


def test_a_sender_stopping_mid_run_fails_the_handoff_and_every_lease_comes_back(staged) -> None:
    ends = staged(SMOLLM2)
    with pytest.raises(KVTransferError, match="stopped after 2 blocks"):
        ends.send(16 * 6, fault=TransferFault(stop_after_blocks=2))
    dest = ends.sink.wait_opened(5)
    assert dest.settled.wait(10) and dest.outcome == "failed" and dest.written == []
    assert ends.sink.num_used == 0
    source = ends.send(16 * 6, seed=1)  # the same ends serve the next handoff, through the same buffers
    assert ends.allocated() == [1, 1, 1, 1]
    assert torch.equal(ends.sink.destinations[1].blocks(), source.blocks)


def test_a_refused_handoff_leases_nothing(staged) -> None:
    ends = staged(SMOLLM2, refuse=KVTransferError("no free KV blocks"))
    with pytest.raises(KVTransferError, match="no free KV blocks"):
        ends.send(16 * 6)
    assert ends.leased() == 0 and ends.sink.num_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_on_a_gpu_a_handoff_stages_in_pinned_memory_and_reuses_it(staged) -> None:
    """Both ends on cuda stage by themselves (pinned host memory, device memory), land every byte, and a second
    handoff allocates nothing."""
    layout = dataclasses.replace(SMOLLM2, dtype="bfloat16")
    ends = staged(layout, "cuda:0", scatters=True)
    assert ends.sender.staging is not None and ends.receiver.staging is not None
    for seed in range(2):
        source = ends.send(1000, seed=seed)
        dest = ends.sink.destinations[-1]
        assert dest.outcome == "committed" and dest.scatters == 1
        assert torch.equal(dest.blocks().view(torch.uint8), source.blocks.view(torch.uint8))
    assert ends.allocated() == [1, 1, 1, 1]
    with ends.sender.staging.pinned.lease(1) as buffer:
        assert buffer.is_pinned()


def test_a_handoff_over_the_staging_limit_goes_block_by_block_and_stages_nothing(staged, monkeypatch) -> None:
    from kv_transfer import grpc_transport

    monkeypatch.setattr(grpc_transport, "STAGE_MAX_BYTES", 5 * SMOLLM2.block_bytes)
    ends = staged(SMOLLM2)
    big = ends.send(16 * 6)  # 6 blocks: over the limit, not staged
    assert ends.allocated() == [0, 0, 0, 0]
    small = ends.send(16 * 5, seed=1)  # 5: staged
    assert ends.allocated() == [1, 1, 1, 1]
    assert [torch.equal(d.blocks(), s.blocks) for d, s in zip(ends.sink.destinations, (big, small))] == [True, True]
