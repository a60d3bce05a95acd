"""The long-running commands' shared lifecycle (deploy/lifecycle.py): the run loop's exit status and error line,
a throttled check, the ready line's pool count, and the two-signal shutdown (the second kills every child)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from deploy.lifecycle import ShutdownSignals, describe_pools, every, run_until_signalled
from protos.worker_info import WorkerInfo

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_signal_ends_the_run_with_status_0_without_running_the_checks() -> None:
    stop = threading.Event()
    stop.set()
    calls: list[int] = []
    assert run_until_signalled(stop, lambda: calls.append(1) or "never asked", poll_s=0.001) == 0
    assert calls == []


def test_the_first_failing_check_ends_the_run_with_status_1_and_its_error_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    answers = iter([None, None, "the cluster controller died"])
    later: list[int] = []

    def later_check() -> str | None:
        later.append(1)
        return None

    assert run_until_signalled(threading.Event(), lambda: next(answers), later_check, poll_s=0.001) == 1
    assert capsys.readouterr().err == "splitserve: error: the cluster controller died\n"
    assert len(later) == 2  # checks run in order; the one after the failure is not asked that round


def test_every_runs_its_check_on_each_nth_call_only() -> None:
    calls: list[int] = []

    def check() -> str | None:
        calls.append(1)
        return f"failure {len(calls)}"

    throttled = every(3, check)
    assert [throttled() for _ in range(7)] == [None, None, "failure 1", None, None, "failure 2", None]


def test_the_ready_line_counts_the_workers_by_role() -> None:
    def worker(role: str, n: int) -> WorkerInfo:
        return WorkerInfo(worker_id=f"{role}-{n}", role=role, endpoint=f"127.0.0.1:{5000 + n}")

    assert describe_pools([worker("prefill", 0), worker("decode", 1), worker("prefill", 2)]) == \
        "2 prefill, 1 decode workers"
    assert describe_pools([worker("colocated", 0)]) == "1 colocated worker"


def test_the_first_signal_asks_for_a_shutdown_and_restore_puts_the_old_handler_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    signals = ShutdownSignals()
    signals.install()
    try:
        signals.install()  # again, as after ray.init: the handlers found first are still the ones restored
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested.wait(10.0)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_signal_forces_the_exit_and_kills_every_child(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import subprocess, sys, time
        from deploy.lifecycle import ShutdownSignals
        signals = ShutdownSignals()
        signals.install()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        signals.requested.wait()
        print("REQUESTED", flush=True)
        time.sleep(600)  # the clean shutdown that the second signal cuts short
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child_pid = None
    try:
        assert proc.stdout is not None
        child_pid = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "REQUESTED\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # EOF once the child too is gone: it holds our stdout
    finally:
        proc.kill()
        proc.wait()
        if child_pid is not None and _alive(child_pid):  # a failed run leaves no sleeper behind
            os.kill(child_pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "shutting down (signal again to force)" in err and "forced exit" in err
    deadline = time.monotonic() + 30.0  # its pipe closes a moment before the kernel marks it dead
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it was killed and awaits its reaper)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"
