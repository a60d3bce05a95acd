"""Per-key token buckets on a fake clock: exact levels and waits."""

from __future__ import annotations

import pytest

from router.rate_limit import RateLimiter, RateLimits, retry_after_header


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_requests_per_minute_bucket() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimits(requests_per_minute=3), clock=clock)
    assert [limiter.admit("a") for _ in range(3)] == [None, None, None]  # a minute's worth at once
    assert limiter.admit("a") == pytest.approx(20.0)  # one request every 20 s
    assert limiter.admit("b") is None  # keys are independent
    clock.now_s += 10
    assert limiter.admit("a") == pytest.approx(10.0)  # a refusal takes nothing
    clock.now_s += 10
    assert limiter.admit("a") is None
    assert limiter.admit("a") == pytest.approx(20.0)
    clock.now_s += 3600  # refills to the capacity, not beyond
    assert [limiter.admit("a") for _ in range(4)][-1] == pytest.approx(20.0)


def test_tokens_per_minute_charged_after_and_waited_out() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimits(tokens_per_minute=600), clock=clock)  # 10 tokens/s
    assert limiter.admit("a") is None
    limiter.charge_tokens("a", 500)
    assert limiter.admit("a") is None  # 100 left: admitted
    limiter.charge_tokens("a", 300)  # 200 in debt
    assert limiter.admit("a") == pytest.approx(20.0)
    clock.now_s += 19
    assert limiter.admit("a") == pytest.approx(1.0)
    clock.now_s += 1
    assert limiter.admit("a") is None
    limiter.charge_tokens("b", 0)
    assert limiter.admit("b") is None


def test_both_limits_and_the_header() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimits(requests_per_minute=60, tokens_per_minute=60), clock=clock)
    assert limiter.admit("a") is None
    limiter.charge_tokens("a", 90)  # 30 tokens in debt: 30 s; the request bucket would wait 0
    assert limiter.admit("a") == pytest.approx(30.0)
    assert retry_after_header(0.2) == "1" and retry_after_header(1.0) == "1" and retry_after_header(29.01) == "30"
    with pytest.raises(ValueError):
        RateLimits(requests_per_minute=0)
    assert not RateLimits().enabled
