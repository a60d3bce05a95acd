"""API keys at the gateway, as vLLM's `--api-key`: every /v1/* route needs `Authorization: Bearer <key>`.

    ApiKeyRing      the accepted keys: from flags / SPLITSERVE_API_KEY and a file (one per line, `#` comments),
                    the file re-read by `reload()` (serve calls it on SIGHUP); `match(key)` → key id | None
    ApiKeyGuard     a pure ASGI middleware, outermost: a guarded path without a valid key gets 401 in OpenAI's
                    error shape before any byte of its body is read; a key over its rate limit
                    (router/rate_limit.py) gets 429 with Retry-After. The key's id is left in the request's
                    state (`api_key_id`) for the token charge and the metrics.

Guarded: /v1 and everything under it, /tokenize and /detokenize (vLLM leaves those open; they cost this
gateway's CPU), /reset_prefix_cache (router/cache_api.py); /metrics with `metrics_require_key`. Open: /health,
/live, /version, /openapi.json (the request schema, no data), /admin/* (its own token, router/admin.py).

A key is compared in constant time against every accepted key (no early exit). Keys are never logged nor put in
metrics: a key is named by its id, "key-" + the first 8 hex digits of its SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import error_body
from router.rate_limit import RateLimiter, retry_after_header
from router.cache_api import RESET_PATHS
from router.tokenize_api import TOKENIZE_PATHS

logger = logging.getLogger(__name__)

API_KEY_ENV = "SPLITSERVE_API_KEY"
KEY_ID_STATE = "api_key_id"  # the request.state attribute holding the caller's key id


def key_id(key: str) -> str:
    """A key's public name, for metrics and logs."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def read_key_file(path: str | Path) -> list[str]:
    """The keys of a key file: one per line, blank lines and `#` comments skipped, surrounding spaces dropped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


class ApiKeyRing:
    """The accepted keys. `reload()` may run on any thread (a signal handler's); `match` sees either the old set
    or the new one, never a mix."""

    def __init__(self, keys: Sequence[str] = (), *, key_file: str | None = None) -> None:
        self._static = tuple(k for k in keys if k)
        self._key_file = key_file
        self._keys: tuple[tuple[bytes, str], ...] = ()
        self._lock = threading.Lock()
        self.reload(strict=True)

    def __repr__(self) -> str:
        return f"ApiKeyRing({len(self._keys)} keys, key_file={self._key_file!r})"

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def reload(self, *, strict: bool = False) -> int:
        """Re-read the key file; returns the number of keys now accepted. A file that cannot be read or holds no
        key raises with `strict` (start-up), else keeps the keys in force and logs why."""
        keys = list(self._static)
        if self._key_file is not None:
            try:
                keys += read_key_file(self._key_file)
            except OSError as exc:
                if strict:
                    raise ValueError(f"cannot read --api-key-file {self._key_file}: {exc.strerror or exc}") from None
                logger.error("API keys not reloaded: cannot read %s: %s", self._key_file, exc)
                return len(self._keys)
        if not keys:
            if strict:
                raise ValueError("no API key given (--api-key, $SPLITSERVE_API_KEY or a non-empty --api-key-file)")
            logger.error("API keys not reloaded: %s holds no key; keeping the %d in force", self._key_file,
                         len(self._keys))
            return len(self._keys)
        with self._lock:
            self._keys = tuple((k.encode(), key_id(k)) for k in dict.fromkeys(keys))
        logger.info("API keys: %d accepted (%s)", len(self._keys), ", ".join(i for _, i in self._keys))
        return len(self._keys)

    def match(self, given: str) -> str | None:
        """The id of the accepted key equal to `given`, else None; the same work whatever matches."""
        given_bytes = given.encode()
        found = None
        for key, kid in self._keys:
            if hmac.compare_digest(given_bytes, key):
                found = kid
        return found


@dataclass(frozen=True, kw_only=True)
class AccessControl:
    """What ApiKeyGuard enforces. `limiter` None: no rate limits."""

    ring: ApiKeyRing = field(repr=False)
    limiter: RateLimiter | None = None
    metrics_require_key: bool = False


def bearer_token(headers: Headers) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ApiKeyGuard:
    """Wraps `app`; see the module docstring. `on_rejected(reason)` counts refusals (missing_key | invalid_key |
    rate_limited); `on_admitted(key_id)` counts admitted requests per key."""

    def __init__(self, app: ASGIApp, *, access: AccessControl, on_rejected: Callable[[str], None] = lambda _: None,
                 on_admitted: Callable[[str], None] = lambda _: None) -> None:
        self.app = app
        self.access = access
        self._on_rejected = on_rejected
        self._on_admitted = on_admitted

    def guarded(self, path: str) -> bool:
        return (path == "/v1" or path.startswith("/v1/") or path in TOKENIZE_PATHS or path in RESET_PATHS
                or (self.access.metrics_require_key and path == "/metrics"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope))
        kid = self.access.ring.match(token) if token is not None else None
        if kid is None:
            reason = "missing_key" if token is None else "invalid_key"
            self._on_rejected(reason)
            message = ("a valid API key is required: send Authorization: Bearer <key>" if token is None
                       else "invalid API key")
            response = JSONResponse(error_body(401, message), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        limiter = self.access.limiter
        if limiter is not None and scope["path"] != "/metrics":
            wait_s = limiter.admit(kid)
            if wait_s is not None:
                self._on_rejected("rate_limited")
                response = JSONResponse(
                    error_body(429, f"rate limit of API key {kid} exceeded; retry in {wait_s:.1f} s"),
                    status_code=429, headers={"Retry-After": retry_after_header(wait_s)})
                await response(scope, receive, send)
                return
        self._on_admitted(kid)
        scope.setdefault("state", {})[KEY_ID_STATE] = kid
        await self.app(scope, receive, send)
