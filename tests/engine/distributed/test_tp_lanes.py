"""KV handoffs as lanes (kv_transfer/rank_lanes.py): each sender rank streams its own KV heads, from its own process,
to each receiver rank's own endpoint, between real rank processes of the tiny model (2 KV heads:
TP 2 splits them, TP 4 replicates each on two ranks), over grpc, torch (gloo) and ipc.

A prompt prefilled at TP a and decoded at TP b gives the colocated TP 1 answer; every rank moves exactly its lanes'
bytes; a corrupted lane, a lane that comes twice or late, and a cancelled reservation write nothing and leave no
block held on any engine.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from engine import SamplingParams
from kv_transfer.base import TransferFault
from kv_transfer.layout import KVChecksumError, KVHandoff, KVRefused, KVTransferError
from kv_transfer.rank_lanes import LANE_TRANSPORTS, RankLanes, rank_view, send_lanes
from kv_transfer.registry import make_sender
from kv_transfer.reservation import Reservation, ReservationSink, ReservationState
from kv_transfer.tp_slices import RankCache, WireBlocks
from protos.cluster_auth import OPEN
from tests.engine.kv_harness import steps_until_finished
from tests.engine.tiny_model import PROMPTS, assert_no_blocks_held, drain, make_engine
from tests.kv_transfer.transfer_peer import serve_receiver

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ENGINE = dict(block_size=4, num_kv_blocks=24, max_model_len=64, num_threads=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = PROMPTS[1]  # 10 tokens: 3 blocks of 4


class Side:
    """An engine with its ranks' lanes started and rank 0's receiver served on a loopback server, over `transport`."""

    def __init__(self, engine, transport: str, device: torch.device = torch.device("cpu")) -> None:  # noqa: ANN001
        self.engine = engine
        layout = engine.kv_blocks.layout
        self.sink = ReservationSink(layout, device)
        self.server, self.endpoint, self.receiver = serve_receiver(transport, self.sink)
        self.lanes: RankLanes | None = engine.rank_lanes()
        children = [] if self.lanes is None else self.lanes.start(
            transport, layout, OPEN, host="127.0.0.1", advertise_host="", worker_id=f"tp{layout.tensor_parallel_size}",
            serve=True)
        self.endpoints = [self.endpoint, *children]
        self.sender = make_sender(transport, worker_id="prefill", device=device)

    @property
    def own(self) -> RankCache:
        blocks = self.engine.kv_blocks
        return RankCache(layout=blocks.layout, rank=0, kv_cache=blocks.kv_cache, kv_scales=blocks.kv_scales)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.server.stop(grace=None)
        self.engine.close()


@pytest.fixture(scope="module")
def sides(request, tiny_checkpoint):  # noqa: ANN001, ANN201
    """{tp: Side} for TP 1, 2 and 4 (and -2: a second TP 2, to hand off to from the first) over the transport the
    test names (`request.param`), and the colocated TP 1 answer to PROMPT."""
    made = {tp: Side(make_engine(tiny_checkpoint, tensor_parallel_size=abs(tp), **ENGINE), request.param)
            for tp in (1, 2, 4, -2)}
    reference = make_engine(tiny_checkpoint, **ENGINE)
    reference.add_request("ref", PROMPT, PARAMS)
    expected = steps_until_finished(reference, "ref")
    yield made, expected
    for side in made.values():
        side.close()


class FaultyLanes:
    """A RankLanes whose child sends lane `lane` with `fault`."""

    def __init__(self, lanes: RankLanes, lane: tuple[int, int], fault: TransferFault) -> None:
        self.lanes, self.lane, self.fault = lanes, lane, fault

    def send(self, rank, handoff, block_ids, endpoint, timeout_s):  # noqa: ANN001, ANN201
        return self.lanes.send(rank, handoff, block_ids, endpoint, timeout_s,
                               fault=self.fault if handoff.lane == self.lane else None)


def reserve(prefill: Side, decode: Side, request_id: str) -> tuple[Reservation, KVHandoff, list[int]]:
    """Prefill PROMPT (held for a remote decode), reserve its blocks on `decode` with lanes; the reservation, the
    handoff that fills it and the prefill's held block ids."""
    prefill.engine.enqueue(prefill.engine.make_request(request_id, PROMPT, PARAMS, remote_decode=True))
    steps_until_finished(prefill.engine, request_id)
    request = decode.engine.make_request(request_id, PROMPT, PARAMS)
    reserved = decode.engine.reserve_remote(request)
    assert reserved is not None
    blocks = decode.engine.kv_blocks
    transfer_id = uuid.uuid4().hex
    reservation = Reservation(request_id, request.num_prompt_tokens, reserved.block_ids, blocks.kv_cache,
                              blocks.layout, first_block=reserved.num_held_blocks, kv_scales=blocks.kv_scales,
                              transfer_id=transfer_id, ranks=blocks.ranks, lanes=decode.lanes)
    decode.sink.add(reservation)
    handoff = KVHandoff(request_id=request_id, transfer_id=transfer_id, num_tokens=request.num_prompt_tokens,
                        layout=prefill.engine.kv_blocks.layout, first_block=reserved.num_held_blocks,
                        receiver_tensor_parallel_size=blocks.layout.tensor_parallel_size)
    return reservation, handoff, prefill.engine.held_block_ids(request_id)


def settle(prefill: Side, decode: Side, request_id: str, reservation: Reservation) -> None:
    """What the workers do after a handoff: the prefill lets go of its hold, the decode of its reservation (and of
    the request, unless it committed)."""
    prefill.engine.release_held(request_id)
    decode.sink.remove(request_id)
    if reservation.state is not ReservationState.COMMITTED:
        reservation.cancel("test")
        decode.engine.abort_request([request_id])


def every_block_back(*sides: Side) -> None:
    for side in sides:
        drain(side.engine)
        assert_no_blocks_held(side.engine)


def moved(lanes: RankLanes | None, side: str) -> dict[int, int]:
    return {} if lanes is None else dict(getattr(lanes, f"bytes_{side}"))


@pytest.mark.parametrize("sides", LANE_TRANSPORTS, indirect=True)
@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4)])
def test_each_rank_sends_and_takes_its_own_heads_and_the_answer_is_tp1s(sides, sender_tp: int,
                                                                        receiver_tp: int) -> None:
    made, expected = sides
    prefill, decode = made[sender_tp], made[-receiver_tp if receiver_tp == sender_tp else receiver_tp]
    request_id = f"lanes-{sender_tp}-{receiver_tp}"
    sent_before, received_before = moved(prefill.lanes, "sent"), moved(decode.lanes, "received")
    reservation, handoff, block_ids = reserve(prefill, decode, request_id)
    try:
        result = send_lanes(handoff, own=prefill.own, block_ids=block_ids, endpoints=decode.endpoints,
                            sender=prefill.sender, ranks=prefill.lanes, timeout_s=30)
        assert reservation.done.wait(5) and reservation.state is ReservationState.COMMITTED, reservation.error
    finally:
        settle(prefill, decode, request_id, reservation)
    decode.engine.commit_remote(request_id, expected[0], None)
    assert steps_until_finished(decode.engine, request_id) == expected
    # Each lane's bytes, from its sender rank's process to its receiver rank's: the plan's units between them.
    num_blocks = len(handoff.block_indices)
    unit_bytes = handoff.wire_layout.block_bytes
    want: dict[tuple[str, int], int] = {}
    for unit in handoff.wire.units:
        want["sent", unit.sender_rank] = want.get(("sent", unit.sender_rank), 0) + num_blocks * unit_bytes
        want["received", unit.receiver_rank] = want.get(("received", unit.receiver_rank), 0) + num_blocks * unit_bytes
    assert result.num_bytes == sum(v for (side, _), v in want.items() if side == "sent") == handoff.num_bytes
    assert reservation.num_bytes == handoff.num_bytes
    sent_after, received_after = moved(prefill.lanes, "sent"), moved(decode.lanes, "received")
    for rank in range(1, sender_tp):
        assert sent_after.get(rank, 0) - sent_before.get(rank, 0) == want.get(("sent", rank), 0), rank
    for rank in range(1, receiver_tp):
        assert received_after.get(rank, 0) - received_before.get(rank, 0) == want.get(("received", rank), 0), rank
    every_block_back(prefill, decode)


@pytest.mark.parametrize("sides", LANE_TRANSPORTS, indirect=True)
def test_a_corrupted_lane_of_a_child_rank_fails_the_handoff_on_every_rank(sides) -> None:
    """Rank 1 of the prefill flips a byte of its last wire block to decode rank 1: that rank's check fails it, the
    reservation fails, the sender raises the checksum error, and no engine holds a block."""
    made, _ = sides
    prefill, decode = made[2], made[-2]
    reservation, handoff, block_ids = reserve(prefill, decode, "corrupt")
    lane = handoff.with_lane(1, 1)
    faulty = FaultyLanes(prefill.lanes, (1, 1), TransferFault(corrupt_block=lane.wire_indices[-1], corrupt_byte=-1))
    try:
        with pytest.raises(KVChecksumError, match="lane \\(1, 1\\) from rank 1"):
            send_lanes(handoff, own=prefill.own, block_ids=block_ids, endpoints=decode.endpoints,
                       sender=prefill.sender, ranks=faulty, timeout_s=30)
        assert reservation.done.wait(5) and reservation.state is ReservationState.FAILED
        assert "lane (1, 1)" in (reservation.error or "")
    finally:
        settle(prefill, decode, "corrupt", reservation)
    every_block_back(prefill, decode)


@pytest.mark.parametrize("sides", ["grpc"], indirect=True)
def test_a_lane_that_comes_again_or_after_a_cancel_is_refused_at_once(sides) -> None:
    """A child rank takes each lane of a reservation once, and none after rank 0 cancelled it: no late sender
    writes into blocks another request may own by then."""
    made, _ = sides
    prefill, decode = made[2], made[-2]
    reservation, handoff, block_ids = reserve(prefill, decode, "again")
    try:
        send_lanes(handoff, own=prefill.own, block_ids=block_ids, endpoints=decode.endpoints, sender=prefill.sender,
                   ranks=prefill.lanes, timeout_s=30)
        assert reservation.done.wait(5) and reservation.state is ReservationState.COMMITTED
        # the same lane again, to decode rank 1 (which forgot the committed reservation)
        with pytest.raises(KVTransferError, match="refused: rank 1: no blocks are reserved"):
            prefill.lanes.send(1, handoff.with_lane(1, 1), block_ids, decode.endpoints[1], 10).result(timeout=10)
        # and to rank 0, which still holds the committed reservation
        lane = handoff.with_lane(0, 0)
        source = WireBlocks(rank_view(prefill.own), block_ids, lane.wire, sender=True)
        with pytest.raises(KVTransferError, match="KV committed, refusing lane \\(0, 0\\)"):
            prefill.sender.send(lane, source, endpoint=decode.endpoints[0], timeout_s=10)
    finally:
        settle(prefill, decode, "again", reservation)
    decode.engine.abort_request(["again"])

    cancelled, handoff, block_ids = reserve(prefill, decode, "cancelled")
    try:
        cancelled.cancel("the client left")  # before any lane: the children drop it, and answer
        with pytest.raises(KVTransferError, match="refused: rank 1: no blocks are reserved"):
            prefill.lanes.send(1, handoff.with_lane(1, 1), block_ids, decode.endpoints[1], 10).result(timeout=10)
    finally:
        settle(prefill, decode, "cancelled", cancelled)

    # The decode worker's failed-stream path lets go of a reservation (the sink forgets it) before it cancels it.
    let_go, handoff, block_ids = reserve(prefill, decode, "let-go")
    try:
        decode.sink.remove("let-go")  # the children cancel it, and answer
        started_s = time.monotonic()
        let_go.cancel("request failed before its first token")
        # the old wait was 20 s; a round trip under the suite's load takes far less than 5
        assert time.monotonic() - started_s < 5.0, "cancel waited for children that were told already"
        with pytest.raises(KVTransferError, match="refused: rank 1: no blocks are reserved"):
            prefill.lanes.send(1, handoff.with_lane(1, 1), block_ids, decode.endpoints[1], 10).result(timeout=10)
    finally:
        settle(prefill, decode, "let-go", let_go)
    every_block_back(prefill, decode)


@pytest.mark.parametrize("sides", ["grpc"], indirect=True)
def test_a_whole_handoff_to_a_worker_whose_ranks_take_lanes_only_is_refused(sides) -> None:
    """Where the children's caches are not mapped into rank 0 (a GPU), rank 0 refuses a handoff of every rank's
    heads, naming the lanes, before any byte."""
    made, _ = sides
    decode = made[2]
    blocks = decode.engine.kv_blocks
    reservation = Reservation("unmapped", 10, [0, 1, 2], blocks.kv_cache, blocks.layout, kv_scales=blocks.kv_scales)
    handoff = KVHandoff(request_id="unmapped", transfer_id="t", num_tokens=10, layout=made[1].engine.kv_blocks.layout,
                        receiver_tensor_parallel_size=2)
    with pytest.raises(KVRefused, match="as lanes, each at its own endpoint"):
        reservation.open(handoff)
    with pytest.raises(KVRefused, match="goes to receiver rank 1's own endpoint"):
        reservation.open(handoff.with_lane(0, 1))
    assert reservation.state is ReservationState.RESERVED
