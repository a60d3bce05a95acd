"""The CPU tensor-parallel group's shared-memory collectives (engine/distributed/shm_collectives.py), between real
processes: sums (rounded once, whatever the order of the ranks) and gathers equal torch's over long mixed sequences
(tensors larger than a slot go in pieces, the slots alternate), every rank holds the same bits, and a wait ends
(never hangs) when a rank dies, the group closes or the timeout passes. The engine at TP > 1 uses them by default
(tests/engine/distributed/test_tensor_parallel.py; gloo's path stays there, and answers the same)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from engine.distributed import rank_worker, shm_collectives
from engine.distributed.shm_collectives import CollectiveAborted, GroupClosed, ShmCollectives

pytestmark = pytest.mark.skipif(not shm_collectives.supported(), reason="shared-memory collectives are x86-64 only")

SLOT_BYTES = 4096  # small, so that most tensors here go in several pieces
NUM_OPS = 40


def _input(op: int, rank: int) -> tuple[str, torch.Tensor]:
    """Operation `op`'s kind and rank `rank`'s tensor for it (every rank can compute every rank's)."""
    g = torch.Generator().manual_seed(op * 101 + rank)
    kind = ("all_reduce", "gather")[int(torch.randint(0, 2, (1,), generator=torch.Generator().manual_seed(op)))]
    dtype = (torch.float32, torch.bfloat16)[op % 2]
    rows = int(torch.randint(0, 5, (1,), generator=torch.Generator().manual_seed(op + 7)))
    cols = int(torch.randint(1, 1500, (1,), generator=torch.Generator().manual_seed(op + 13)))
    return kind, torch.randn(rows, cols, generator=g).to(dtype)


def _proc_path(shared: shm_collectives.SharedFile) -> str:
    """The file's /proc entry, which these tests' spawned processes open (an engine hands its children the
    descriptor itself, over their pipes)."""
    return f"/proc/{os.getpid()}/fd/{shared.fd}"


def _attach(path: str, **kwargs: object) -> ShmCollectives:
    fd = os.open(path, os.O_RDWR)
    try:
        return ShmCollectives(fd, **kwargs)  # type: ignore[arg-type]
    finally:
        os.close(fd)


def _run_rank(path: str, rank: int, world_size: int, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    try:
        group = _attach(path, rank=rank, world_size=world_size, timeout_s=30, slot_bytes=SLOT_BYTES)
        sums = []
        for op in range(NUM_OPS):
            kind, mine = _input(op, rank)
            inputs = [_input(op, r)[1] for r in range(world_size)]
            if kind == "all_reduce":
                # Two: one addition. More: the exact sum (float64 holds it) rounded once, whatever the order.
                expected = inputs[0] + inputs[1] if world_size == 2 else sum(i.double() for i in inputs).to(mine.dtype)
                got = group.all_reduce(mine.clone())
                assert torch.equal(got, expected), f"op {op}: rank {rank}'s sum differs from torch's"
                sums.append(got)
            else:
                parts = group.gather(mine)
                if rank == 0:
                    assert parts is not None and len(parts) == world_size
                    assert all(torch.equal(p, i) for p, i in zip(parts, inputs, strict=True)), f"op {op}: gather"
                else:
                    assert parts is None
        results.put((rank, "ok", [s.float().sum().item() for s in sums]))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}", []))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sums_and_gathers_equal_torchs_on_every_rank(world_size: int) -> None:
    shared = shm_collectives.create(world_size, SLOT_BYTES)
    assert shared is not None
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_run_rank, args=(_proc_path(shared), r, world_size, results), daemon=True)
             for r in range(1, world_size)]
    for p in procs:
        p.start()
    try:
        _run_rank(_proc_path(shared), 0, world_size, results)
        reports = sorted(results.get(timeout=120) for _ in range(world_size))
    finally:
        shared.close()
        for p in procs:
            p.join(10)
    assert [status for _, status, _ in reports] == ["ok"] * world_size, reports
    assert all(sums == reports[0][2] for _, _, sums in reports)  # the same bits on every rank
    assert any(kind == "all_reduce" for kind, _ in map(_input, range(NUM_OPS), [0] * NUM_OPS))


def _group_of_two(timeout_s: float = 30) -> tuple[shm_collectives.SharedFile, ShmCollectives]:
    shared = shm_collectives.create(2, SLOT_BYTES)
    assert shared is not None
    return shared, ShmCollectives(shared.fd, rank=0, world_size=2, timeout_s=timeout_s, slot_bytes=SLOT_BYTES)


def test_a_rank_that_never_comes_times_out() -> None:
    shared, group = _group_of_two(timeout_s=0.3)
    start_s = time.monotonic()
    with pytest.raises(CollectiveAborted, match="did not reach a collective within"):
        group.all_reduce(torch.ones(8))
    assert time.monotonic() - start_s < 5
    shared.close()


def test_abort_ends_a_wait_at_once() -> None:
    shared, group = _group_of_two()
    threading.Timer(0.2, group.abort).start()
    start_s = time.monotonic()
    with pytest.raises(GroupClosed, match="closed") as raised:  # a child rank exits on it without a traceback
        group.gather(torch.ones(8))
    assert time.monotonic() - start_s < 5
    assert rank_worker._closed_by_rank_0(raised.value)
    assert not rank_worker._closed_by_rank_0(CollectiveAborted("tensor-parallel rank 2 did not reach a collective"))
    shared.close()


def _mapped_then_sleeps(path: str, mapped: multiprocessing.Event) -> None:
    _attach(path, rank=1, world_size=2, timeout_s=300, slot_bytes=SLOT_BYTES)
    mapped.set()
    time.sleep(300)


def test_a_rank_killed_while_rank_0_waits_fails_the_collective_fast() -> None:
    """Rank 1 mapped the memory, then is SIGKILLed while rank 0 waits for it: rank 0's liveness check (the
    RankGroup's `dead` in an engine) ends the wait within a fraction of a second, naming it."""
    shared, group = _group_of_two(timeout_s=300)
    ctx = multiprocessing.get_context("spawn")
    mapped = ctx.Event()
    child = ctx.Process(target=_mapped_then_sleeps, args=(_proc_path(shared), mapped), daemon=True)
    child.start()
    assert mapped.wait(60)
    group.peers_dead = lambda: None if child.is_alive() else f"rank 1 (pid {child.pid}) was killed"
    threading.Timer(1.0, lambda: os.kill(child.pid, 9)).start()  # type: ignore[arg-type]
    start_s = time.monotonic()
    with pytest.raises(CollectiveAborted, match="rank 1 .* was killed"):
        group.all_reduce(torch.ones(8))
    assert 0.9 < time.monotonic() - start_s < 10
    shared.close()


def _waits_for_rank_2(path: str, outcome: multiprocessing.Queue) -> None:
    group = _attach(path, rank=1, world_size=3, timeout_s=300, slot_bytes=SLOT_BYTES)
    start_s = time.monotonic()
    try:
        group.all_reduce(torch.ones(8))  # rank 2 never comes
    except CollectiveAborted as exc:
        outcome.put((str(exc), time.monotonic() - start_s))


def test_abort_releases_a_child_waiting_for_another() -> None:
    """A child (rank 1) waits for rank 2, which never came; rank 0 closing the group (RankGroup.close's abort) ends
    the child's wait at once, not after the 300 s timeout."""
    shared = shm_collectives.create(3, SLOT_BYTES)
    assert shared is not None
    group = ShmCollectives(shared.fd, rank=0, world_size=3, timeout_s=300, slot_bytes=SLOT_BYTES)
    ctx = multiprocessing.get_context("spawn")
    outcome = ctx.Queue()
    child = ctx.Process(target=_waits_for_rank_2, args=(_proc_path(shared), outcome), daemon=True)
    child.start()
    time.sleep(2.0)
    group.abort()
    message, waited_s = outcome.get(timeout=60)
    assert "closed" in message and waited_s < 60
    child.join(10)
    shared.close()


def test_the_choice_and_no_memory_for_it(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(shm_collectives.ENV, "gloo")
    assert not shm_collectives.supported()
    monkeypatch.setenv(shm_collectives.ENV, "nccl")
    with pytest.raises(ValueError, match="expected shm or gloo"):
        shm_collectives.supported()
    monkeypatch.delenv(shm_collectives.ENV)
    assert shm_collectives.supported()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert shm_collectives.create(2) is None
    assert "stay on gloo" in caplog.text
