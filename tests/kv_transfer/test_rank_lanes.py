"""Rank 0's end of its children's lane pipes (kv_transfer/rank_lanes.py `RankLanes`), over real pipes: a child that
goes (its pipe closes) fails what waits on it and every reservation's lanes, and later calls fail at once."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from kv_transfer.layout import KVHandoff, KVLayout, KVTransferError
from kv_transfer.rank_lanes import Cancel, Expect, RankLanes, Reply, Send, Settled

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", tensor_parallel_size=2)


def test_a_child_whose_pipe_closes_fails_its_sends_and_every_reservations_lanes() -> None:
    parent, child = multiprocessing.Pipe()
    lanes = RankLanes([parent], world_size=2)
    settled: list[Settled] = []
    heard = threading.Event()

    def on_settled(message: Settled) -> None:
        settled.append(message)
        heard.set()

    try:
        lanes.expect(Expect("t1", "r1", (0, 1, 2), 0, 10, "prefill:1"), on_settled)
        assert isinstance(child.recv(), Expect)
        handoff = KVHandoff(request_id="r1", transfer_id="t1", num_tokens=10, layout=LAYOUT,
                            receiver_tensor_parallel_size=2).with_lane(1, 1)
        pending = lanes.send(1, handoff, [0, 1, 2], "decode:1", 5)
        assert isinstance(child.recv(), Send)
        child.close()  # the child died
        with pytest.raises(KVTransferError, match="tensor-parallel rank 1 is gone"):
            pending.result(timeout=5)
        assert heard.wait(5)
        assert settled[0].transfer_id == "t1" and settled[0].lane == (-1, 1)
        assert "rank 1 is gone" in (settled[0].error or "")
        # later: at once, without a pipe to write to
        with pytest.raises(KVTransferError, match="rank 1 is gone"):
            lanes.send(1, handoff, [0, 1, 2], "decode:1", 5).result(timeout=1)
        lanes.cancel("t1", "gone anyway")  # returns: a gone child writes nothing
        heard.clear()
        lanes.expect(Expect("t2", "r2", (3,), 0, 4, ""), on_settled)  # a new reservation learns at once
        assert heard.wait(5) and settled[-1].transfer_id == "t2" and settled[-1].error
    finally:
        lanes.close()


def test_cancel_waits_for_the_childs_answer_and_settlements_reach_their_reservation() -> None:
    parent, child = multiprocessing.Pipe()
    lanes = RankLanes([parent], world_size=2)
    settled: list[Settled] = []
    heard = threading.Event()
    lanes.expect(Expect("t", "r", (0,), 0, 4, ""), lambda m: (settled.append(m), heard.set()))
    assert isinstance(child.recv(), Expect)
    child.send(Settled("t", (0, 1), 1, None, 128))
    assert heard.wait(5) and settled == [Settled("t", (0, 1), 1, None, 128)]
    assert lanes.bytes_received[1] == 128
    done = threading.Event()

    def cancel() -> None:
        lanes.cancel("t", "aborted")
        done.set()

    thread = threading.Thread(target=cancel)
    thread.start()
    message = child.recv()
    assert isinstance(message, Cancel) and message.transfer_id == "t"
    assert not done.wait(0.2), "cancel returned before the child answered"
    child.send(Reply(message.token))
    thread.join(5)
    assert done.is_set()
    child.send(Settled("t", (1, 1), 1, None, 64))  # after the cancel: nobody listens for it any more
    lanes.close()


def test_a_child_that_does_not_confirm_a_cancel_is_stopped_before_the_cancel_returns(monkeypatch) -> None:  # noqa: ANN001
    """It might still be writing into the blocks the caller frees next: the group is failed (every child killed)
    first, through `on_stuck`."""
    from kv_transfer import rank_lanes

    monkeypatch.setattr(rank_lanes, "REPLY_S", 0.3)
    parent, child = multiprocessing.Pipe()
    stuck: list[str] = []
    lanes = RankLanes([parent], world_size=2, on_stuck=stuck.append)
    try:
        lanes.cancel("t", "aborted")  # the child reads nothing, answers nothing
        assert len(stuck) == 1 and "rank 1 did not confirm cancelling KV transfer t" in stuck[0]
        assert isinstance(child.recv(), Cancel)
        done = threading.Event()
        lanes.cancel_later("u", "aborted", done.set)  # the same, on a thread of its own, then the callback
        assert done.wait(5) and len(stuck) == 2
    finally:
        lanes.close()
