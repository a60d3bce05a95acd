"""The life of a long-running `splitserve` command (`serve`, `head`, `gateway`), from start-up to the last child
reaped; what the three share.

    ShutdownSignals().install() ──▶ start: wait_for(a Ray start call, the stop event)  ── StartFailed: exit 1
        ──▶ the ready line ("... (2 prefill, 1 decode workers)": describe_pools)
        ──▶ run_until_signalled(stop, checks...): 0 on SIGINT / SIGTERM, 1 once a check reports a failure
        ──▶ shutdown (each command's own order; a controller it owns: stop_controller) ──▶ reap_descendants
        ──▶ signals.restore()

Signals: the first SIGINT or SIGTERM asks for a clean shutdown (it sets an event, nothing more), a second one
forces the exit at once, killing every process below this one. Nothing here imports Ray until a function that
talks to Ray is called, so the fixed-list gateway (no Ray at all) uses this module too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protos.worker_info import WorkerInfo

CONTROLLER_SHUTDOWN_GRACE_S = 30.0  # the controller stops all workers in parallel, each within stop_timeout_s
POLL_S = 0.5  # how often a running command looks at its signals and runs its checks

# A running command's liveness check: None while all is well, else why the command must stop (its error line).
Check = Callable[[], str | None]


class ShutdownSignals:
    """SIGINT and SIGTERM: the first sets `requested` (a clean shutdown), a second forces the exit at once, killing
    every process this one started (Ray ties raylet and GCS to their parent's life, but not the agents raylet
    starts), with status 128 + the signal's number.

    `install()` may be called again, to put these handlers back on top of someone else's (ray.init installs its own
    SIGTERM handler); `restore()` puts back the handlers found by the first `install()`. Main thread only."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested.is_set():
            os.write(2, b"splitserve: forced exit\n")
            kill_descendants()
            os._exit(128 + signum)
        self.requested.set()
        os.write(2, b"splitserve: shutting down (signal again to force)\n")


# -- start-up ------------------------------------------------------------------------------------------------
class StartFailed(Exception):
    """The cluster could not start (workers that do not start, a controller that died starting, a router that
    cannot serve): the command prints it as its error line and exits 1."""


def wait_for(ref: Any, stop: threading.Event) -> Any:
    """ray.get of `ref` that gives up, returning None, once `stop` is set (a shutdown asked for while starting).
    The remote call's error, or its actor's death, raises StartFailed saying why."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    while not stop.is_set():
        ready, _ = ray.wait([ref], timeout=0.2)
        if ready:
            try:
                return ray.get(ref)
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                raise StartFailed(str(cause) if cause is not None else str(exc)) from None
            except RayActorError as exc:
                raise StartFailed(f"the cluster controller died while starting: {exc}") from None
    return None


def describe_pools(workers: list[WorkerInfo]) -> str:
    """The ready line's account of the workers, by role in order of first appearance: "2 prefill, 1 decode
    workers", "1 colocated worker"."""
    counts: dict[str, int] = {}
    for w in workers:
        counts[w.role] = counts.get(w.role, 0) + 1
    return ", ".join(f"{n} {role}" for role, n in counts.items()) + " worker" + ("s" if len(workers) != 1 else "")


# -- running -------------------------------------------------------------------------------------------------
def run_until_signalled(stop: threading.Event, *checks: Check, poll_s: float = POLL_S) -> int:
    """Block until `stop` is set (a shutdown signal: returns 0) or a check reports that what the command runs
    failed (returns 1, its reason printed on stderr as "splitserve: error: <reason>"). Every `poll_s` the checks
    run in order, the first failure ending the wait; with no check this only waits for the signal."""
    while not stop.wait(poll_s):
        for check in checks:
            reason = check()
            if reason is not None:
                print(f"splitserve: error: {reason}", file=sys.stderr)
                return 1
    return 0


def every(n: int, check: Check) -> Check:
    """`check` run on every `n`-th call only (None on the others): a check that costs a remote call, at a
    fraction of the poll rate."""
    num_calls = 0

    def throttled() -> str | None:
        nonlocal num_calls
        num_calls += 1
        return check() if num_calls % n == 0 else None

    return throttled


# -- shutdown ------------------------------------------------------------------------------------------------
def stop_controller(controller: Any) -> None:
    """Stop a cluster controller actor this command owns: its `shutdown()` (every worker stopped) within
    CONTROLLER_SHUTDOWN_GRACE_S, then the actor killed. Never raises: a controller that timed out or is already
    dead is killed all the same, which takes its worker actors along (Ray owner fate)."""
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=CONTROLLER_SHUTDOWN_GRACE_S)
    except Exception:  # timed out or already dead: killing it takes its worker actors along (Ray owner fate)
        pass
    try:
        ray.kill(controller, no_restart=True)
    except Exception:
        pass


# -- reaping -------------------------------------------------------------------------------------------------
def descendants() -> list[int]:
    """Every live process below this one (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ", comm may hold spaces
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found, stack = [], [os.getpid()]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_descendants() -> None:
    """SIGKILL every live process below this one."""
    for pid in descendants():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def reap_descendants(*, grace_s: float) -> None:
    """Give the processes below this one `grace_s` to exit on their own, then kill those left."""
    deadline = time.monotonic() + grace_s
    while descendants() and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_descendants()
