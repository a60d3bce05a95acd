"""The Ray node a `splitserve head` or `splitserve gateway` process brings up under itself (`--start-ray`).

    RayNode(["ray", "start", "--head", "--port=6379", ...]).start()   # a child, in its own process group
        ... ray.init(address=...) joins through it ...
    node.alive()                                                      # False once its `ray start` exited
    node.stop()                                                       # SIGTERM: `ray start --block` stops its
                                                                      # raylet (and GCS), then SIGKILL if need be

Why a child: a Ray 2.x driver needs a raylet on its own host (it finds one by scanning local processes), so a
container whose process is a driver — the head, which creates the controller, and every gateway replica, which
asks it for the workers — runs its node itself, and the node lives and dies with the container's process. The
command must block (`ray start ... --block`; added when missing): its exit is the node's end, and stopping it
stops everything it started (Ray's `--block` mode kills its children on SIGTERM), never another cluster's
processes as `ray stop` would.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence


class RayNode:
    def __init__(self, command: str | Sequence[str]) -> None:
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        if argv[:2] != ["ray", "start"]:
            raise ValueError(f"--start-ray must be a `ray start ...` command, got {' '.join(argv)!r}")
        if "--block" not in argv:
            argv.append("--block")
        # `ray` of this interpreter's environment, whatever PATH says (a venv not activated, a container)
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        self.argv = [ray_cli if os.path.exists(ray_cli) else "ray", *argv[1:]]
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RayNode:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": os.environ.get("RAY_USAGE_STATS_ENABLED", "0")}
        # its output goes where ours goes (the container's log); its own process group, so that a stop reaches
        # everything it started even if it dies first
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                      preexec_fn=_terminate_with_parent)
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def stop(self, *, grace_s: float = 15.0) -> None:
        """Idempotent."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever of the group outlived the grace
        except OSError:
            pass
        if self._proc.poll() is None:
            self._proc.wait()
        self._proc = None


def _terminate_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when our process dies, however it dies (a SIGKILL included), so
    no Ray node outlives the command that started it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True
