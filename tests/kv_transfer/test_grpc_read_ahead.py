"""The gRPC receiver's read-ahead: messages in order, at most `depth` ahead, a stream's failure raised in its
place, and no thread left behind when the consumer stops early."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kv_transfer.grpc_transport import _read_ahead  # noqa: PLC2701 - the receiver's helper, tested directly
from tests.kv_transfer.transfer_peer import read_ahead_threads_gone


class _Counted:
    """An iterator over 0..n-1 that records how many items were taken from it (and can fail at one)."""

    def __init__(self, n: int, *, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.taken = n, fail_at, 0

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.fail_at:
                raise RuntimeError(f"stream broke at {i}")
            self.taken += 1
            yield i


def test_messages_come_in_order_and_at_most_depth_ahead() -> None:
    source = _Counted(50)
    seen = []
    for item in _read_ahead(iter(source), 2):
        time.sleep(0.002)  # a slow consumer: the puller runs ahead until the queue is full
        # taken = consumed + in the queue (2) + the one the puller holds waiting for room
        assert source.taken <= len(seen) + 1 + 2 + 1
        seen.append(item)
    assert seen == list(range(50))
    assert read_ahead_threads_gone()


def test_a_failing_stream_raises_after_the_messages_before_it() -> None:
    seen = []
    with pytest.raises(RuntimeError, match="stream broke at 7"):
        for item in _read_ahead(iter(_Counted(20, fail_at=7)), 2):
            seen.append(item)
    assert seen == list(range(7))
    assert read_ahead_threads_gone()


def test_a_consumer_that_stops_early_leaves_no_thread() -> None:
    stream = _read_ahead(iter(_Counted(1000)), 2)
    assert [next(stream) for _ in range(3)] == [0, 1, 2]
    stream.close()  # as when the receiver fails a handoff mid-stream
    assert read_ahead_threads_gone()
