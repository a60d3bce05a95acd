"""/proc helpers for the tests that must leave no process behind, and `splitserve serve` run as a subprocess.

    with serving(serve_argv(model, "--prefill-workers", "2"), stderr_path=tmp_path / "stderr.txt") as serve:
        httpx.post(f"{serve.url}/v1/completions", ...)
    # on leaving: serve was still running, SIGINT stopped it (exit 0), nothing of it is left
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, session id, start time) of a live process, or None if it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[3]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process below `root` in the parent tree."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
            starts[pid] = stat[2]
    found: dict[int, int] = {}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found[child] = starts[child]
            stack.append(child)
    return found


def survivors(known: dict[int, int], *, session: int | None = None) -> list[int]:
    """Those of `known` (pid -> start time) still alive as the same process, plus any process in `session`."""
    alive = [pid for pid, start in known.items() if (s := _stat(pid)) is not None and s[2] == start]
    if session is not None:
        alive += [pid for pid in _all_pids() if (s := _stat(pid)) is not None and s[1] == session and pid not in known]
    return sorted(set(alive))


def wait_until_gone(known: dict[int, int], *, session: int | None = None, timeout_s: float = 15.0) -> list[int]:
    """Poll until none of `known` (and nothing in `session`) survives; return the survivors at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := survivors(known, session=session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def processes_titled(prefix: str, *, under: int) -> list[int]:
    """Live processes below `under` whose command line starts with `prefix` (Ray titles an actor's process
    "ray::<Class>")."""
    found = []
    for pid in descendants(under):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(prefix.encode()) and _stat(pid) is not None:
            found.append(pid)
    return found


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            out.append(f"{pid}: {cmdline[:160].decode(errors='replace')}")
        except OSError:
            out.append(f"{pid}: (gone)")
    return out


READY = re.compile(r"^splitserve: serving \S+ on (http://\S+) ")
WORKER_READY = re.compile(r"^ENDPOINT (\S+)$")  # a worker process' (worker/main.py)


class ServeProcess:
    """`serve` in its own session; its stdout is read by a thread so that a chatty child never blocks. `ready`:
    the line that says it serves, its group 1 what `url` becomes (WORKER_READY: a worker process' endpoint)."""

    def __init__(self, argv: list[str], *, stderr_path: Path, env: dict[str, str] | None = None,
                 ready: re.Pattern[str] = READY) -> None:
        self._stderr = stderr_path.open("wb")
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,  # its session id is its pid: anything left in that session is a leak
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready_line = ready
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.url is None and (match := self._ready_line.match(line)):
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> str:
        self._ready.wait(timeout_s)
        assert self.url is not None, f"not ready (exit {self.proc.poll()}):\n{self.output()}"
        return self.url

    def output(self, tail_chars: int | None = 4000) -> str:
        """Its stdout lines and the end of its stderr (all of it with `tail_chars` None: to search it)."""
        self._stderr.flush()
        err = Path(self._stderr.name).read_text(errors="replace")
        return "".join(self.lines) + (err if tail_chars is None else err[-tail_chars:])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._stderr.close()


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def stop_and_check(serve: ServeProcess, signals: list[int], *, expect_code: int) -> None:
    """Send `signals` (half a second apart); expect `expect_code` and nothing of it left running."""
    tree = descendants(serve.proc.pid)
    assert tree, "serve has no child processes: is Ray running elsewhere?"
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.5)
        serve.proc.send_signal(sig)
    try:
        code = serve.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not exit after {[signal.Signals(s).name for s in signals]}:\n{serve.output()}")
    assert code == expect_code, serve.output()
    left = wait_until_gone(tree, session=serve.proc.pid, timeout_s=15)
    assert not left, f"left behind: {describe(left)}"


# A test cluster's KV cache per worker unless its test sizes it: 364 float32 blocks of 16 tokens for SmolLM2
# (~0.7 MiB each), room for 128 running 2-block requests. serve's default (2 GiB) is zeroed at every worker start
# and held all along: 8 GiB for a 2 + 2 cluster on a machine the suite shares.
TEST_KV_CACHE_MEMORY = "256MiB"


def serve_argv(model: str, *flags: str) -> list[str]:
    """`splitserve serve` of `model` on a free port with `flags`; with TEST_KV_CACHE_MEMORY unless `flags` size the
    KV cache themselves (--kv-cache-memory, --num-kv-blocks), and one thread a worker unless they set --num-threads.

    One thread: the suite runs two test files at once on two cores, so a serve has about one core. serve's default
    would give a colocated worker both cores' threads, and OpenMP's threads waiting at their barriers for a
    descheduled peer made its steps up to 18x slower beside one busy core (a 4 s test took 75 s)."""
    named = {f.split("=")[0] for f in flags}
    kv = [] if named & {"--kv-cache-memory", "--num-kv-blocks"} else ["--kv-cache-memory", TEST_KV_CACHE_MEMORY]
    threads = [] if "--num-threads" in named else ["--num-threads", "1"]
    return [sys.executable, "-m", "deploy.cli", "serve", "--model", model, "--port", "0", *kv, *threads, *flags]


@contextlib.contextmanager
def serving(argv: list[str], *, stderr_path: Path, env: dict[str, str] | None = None,
            ready_timeout_s: float = 300.0) -> Iterator[ServeProcess]:
    """`serve` started and ready (its `url` set) for the body; then, unless the body raised, it must still be
    running, and SIGINT must stop it with exit 0 and nothing left (`stop_and_check`). It is killed in any case."""
    serve = ServeProcess(argv, stderr_path=stderr_path, env=env)
    try:
        serve.wait_ready(ready_timeout_s)
        yield serve
        assert serve.proc.poll() is None, f"serve died meanwhile:\n{serve.output()}"
        stop_and_check(serve, [signal.SIGINT], expect_code=0)
    finally:
        serve.close()
