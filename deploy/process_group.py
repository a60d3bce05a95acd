"""Stopping a command started in its own process group (`start_new_session=True`), as a user's Ctrl-C would."""

from __future__ import annotations

import os
import signal
import subprocess


def interrupt_group(proc: subprocess.Popen, *, grace_s: float = 60.0) -> None:
    """SIGINT to `proc`'s group (a `serve` shuts its cluster down on it), then SIGKILL to the group if it has not
    exited within `grace_s`. Nothing when it already exited."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
