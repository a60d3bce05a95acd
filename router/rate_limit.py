"""Per-API-key rate limits: token buckets, pure logic on an injected clock (unit-tested with a fake one).

    requests per minute   a bucket of `rpm` requests, refilled at rpm / 60 per second; a request takes one, or
                          is refused (429) with the seconds until one is back
    tokens per minute     a bucket of `tpm` tokens, refilled at tpm / 60 per second; a request is admitted while
                          the bucket is not in debt, and charged its prompt + generated tokens once they are known
                          (so a long answer may run the bucket into debt, which the next requests wait out)

Charging tokens after the fact is the choice here because a request's cost is unknown at admission (max_tokens
is a ceiling, rarely reached); reserving max_tokens up front would refuse most of what a key may send.
Limits hold per gateway process: two gateway replicas give a key twice the rate.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.config_checks import POSITIVE, check_fields, checked


@dataclass(kw_only=True)
class TokenBucket:
    """`level` units available now, at most `capacity`, refilled at `refill_per_s`; may go negative (debt)."""

    capacity: float
    refill_per_s: float
    level: float
    updated_s: float

    def refill(self, now_s: float) -> None:
        self.level = min(self.capacity, self.level + max(now_s - self.updated_s, 0.0) * self.refill_per_s)
        self.updated_s = now_s

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is now). Call `refill` first."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.refill_per_s


@dataclass(frozen=True, kw_only=True)
class RateLimits:
    """Per key; None: no limit of that kind."""

    requests_per_minute: float | None = checked(POSITIVE, default=None)
    tokens_per_minute: float | None = checked(POSITIVE, default=None)

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


class RateLimiter:
    """Buckets per key id, made full on a key's first request. Thread-safe."""

    def __init__(self, limits: RateLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def admit(self, key_id: str) -> float | None:
        """Take one request for `key_id`: None when admitted, else the seconds to wait (nothing taken)."""
        now_s = self._clock()
        with self._lock:
            requests = self._bucket(self._requests, key_id, self.limits.requests_per_minute, now_s)
            tokens = self._bucket(self._tokens, key_id, self.limits.tokens_per_minute, now_s)
            wait_s = 0.0
            if requests is not None:
                wait_s = max(wait_s, requests.wait_s(1.0))
            if tokens is not None and tokens.level < 0:  # in debt: wait until it is paid back
                wait_s = max(wait_s, tokens.wait_s(0.0))
            if wait_s > 0:
                return wait_s
            if requests is not None:
                requests.level -= 1.0
            return None

    def charge_tokens(self, key_id: str, num_tokens: int) -> None:
        """Charge a finished request's prompt + generated tokens to `key_id`."""
        if self.limits.tokens_per_minute is None or num_tokens <= 0:
            return
        now_s = self._clock()
        with self._lock:
            bucket = self._bucket(self._tokens, key_id, self.limits.tokens_per_minute, now_s)
            assert bucket is not None
            bucket.level -= num_tokens

    @staticmethod
    def _bucket(buckets: dict[str, TokenBucket], key_id: str, per_minute: float | None,
                now_s: float) -> TokenBucket | None:
        if per_minute is None:
            return None
        bucket = buckets.get(key_id)
        if bucket is None:
            bucket = buckets[key_id] = TokenBucket(capacity=per_minute, refill_per_s=per_minute / 60.0,
                                                   level=per_minute, updated_s=now_s)
        else:
            bucket.refill(now_s)
        return bucket


def retry_after_header(wait_s: float) -> str:
    """Retry-After in whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))
