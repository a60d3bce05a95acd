"""PairGroup's rendezvous is bounded by the handoff's deadline even when the peer hosting the store is frozen.

A SIGSTOPped process still has its kernel accept TCP connections, and TCPStore's client handshake then blocks in
recv past its own timeout: the torch transport's sender once hung there forever (a CI failure). Here a real
TCPStore master runs in a subprocess that we freeze before building a pair against it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kv_transfer.layout import KVTransferError
from kv_transfer.pair_group import PairGroup, remaining_s

SLACK_S = 3.0

_MASTER = (
    "import time, torch.distributed as dist\n"
    "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(store.port, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def frozen_store_port() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", _MASTER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        proc.send_signal(signal.SIGSTOP)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("rank", [0, 1], ids=["sender", "receiver"])
def test_rendezvous_with_a_frozen_store_raises_by_the_deadline(frozen_store_port: int, rank: int) -> None:
    pair = PairGroup("kvpair-test", "gloo")
    deadline_s = time.monotonic() + 1.5
    raised: list[BaseException] = []

    def build() -> None:
        try:
            pair.build(store_host="127.0.0.1", store_port=frozen_store_port, rank=rank, local_host="127.0.0.1",
                       device=torch.device("cpu"), deadline_s=deadline_s)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised.append(exc)

    # On a thread, so that a regression fails here instead of hanging the suite in C++ where no timeout reaches.
    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(remaining_s(deadline_s) + SLACK_S)
    assert not thread.is_alive(), "build hung past its deadline"
    assert len(raised) == 1 and isinstance(raised[0], KVTransferError) and "rendezvous" in str(raised[0]), raised
    assert pair.broken and pair.group is None  # never offered again


def test_a_pair_dropped_mid_rendezvous_never_gets_its_group() -> None:
    """Both ends of a real gloo pair rendezvous; the receiver end is dropped before its build can finish, so a
    group that completes late is discarded instead of reviving the pair."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    sender, receiver = PairGroup("kvpair-late", "gloo"), PairGroup("kvpair-late", "gloo")
    receiver.drop()  # dropped before it even starts: its rendezvous must not install a group
    errors: list[BaseException] = []

    def build(pair: PairGroup, rank: int) -> None:
        try:
            pair.build(store_host="127.0.0.1", store_port=store.port, rank=rank, local_host="127.0.0.1",
                       device=torch.device("cpu"), deadline_s=time.monotonic() + 10)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(sender, 0)), threading.Thread(target=build, args=(receiver, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert sender.group is not None and not sender.broken
    assert receiver.group is None and receiver.broken
    assert any("dropped" in str(exc) for exc in errors), errors
    sender.drop()
