"""Range checks declared on config fields (router/config_checks.py): what passes, what fails and how it is said."""

from __future__ import annotations

import dataclasses
import math

import pytest

from router.config import GatewayConfig, RouterConfig
from router.config_checks import (
    AT_LEAST_ONE,
    AT_LEAST_ZERO,
    POSITIVE,
    FieldValueError,
    check_fields,
    checked,
    one_of,
    within,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Example:
    size: int = checked(POSITIVE)
    timeout_s: float = checked(POSITIVE, default=1.5)
    limit: int | None = checked(AT_LEAST_ZERO, default=None)
    attempts: int = checked(AT_LEAST_ONE, default=2)
    port: int = checked(within(0, 65535), default=8000)
    policy: str = checked(one_of(("fast", "slow")), default="fast")
    plain: int = -7  # no check

    def __post_init__(self) -> None:
        check_fields(self)


def test_defaults_pass_and_a_field_without_a_default_is_required() -> None:
    assert _Example(size=1) == _Example(size=1, timeout_s=1.5, limit=None, attempts=2, port=8000, policy="fast")
    with pytest.raises(TypeError, match="size"):
        _Example()  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"size": 0}, "size must be positive, got 0"),
        ({"timeout_s": -0.5}, "timeout_s must be positive, got -0.5"),
        ({"timeout_s": math.nan}, "timeout_s must be positive, got nan"),
        ({"limit": -1}, "limit must be >= 0, got -1"),
        ({"attempts": 0}, "attempts must be at least 1, got 0"),
        ({"port": 65536}, "port must be in 0..65535, got 65536"),
        ({"policy": "odd"}, "policy must be one of fast, slow, got 'odd'"),
    ],
)
def test_a_value_out_of_range_names_its_field_and_the_problem(change: dict[str, object], message: str) -> None:
    with pytest.raises(FieldValueError) as raised:
        _Example(**{"size": 1, **change})  # type: ignore[arg-type]
    assert str(raised.value) == message
    assert (raised.value.field, f"{raised.value.field} {raised.value.problem}") == (next(iter(change)), message)
    assert isinstance(raised.value, ValueError)


def test_none_and_bounds_pass() -> None:
    assert _Example(size=1, limit=0, attempts=1, port=0, timeout_s=1e-9).limit == 0
    assert _Example(size=1, port=65535, plain=-1).port == 65535


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"served_model_names": ()}, "served_model_names must be non-empty names, got ()"),
        ({"max_model_len": 0}, "max_model_len must be positive, got 0"),
        ({"mode": "both"}, "mode must be one of disaggregated, colocated, got 'both'"),
        ({"routing_policy": "random"}, "routing_policy must be one of prefix-aware, least-loaded, round-robin, got "
                                       "'random'"),
        ({"queue_timeout_s": 0.0}, "queue_timeout_s must be positive, got 0.0"),
        ({"max_queued_requests": -1}, "max_queued_requests must be >= 0, got -1"),
        ({"max_dispatch_attempts": 0}, "max_dispatch_attempts must be at least 1, got 0"),
        ({"max_request_body_bytes": 0}, "max_request_body_bytes must be positive, got 0"),
        ({"disagg_prefill_threshold_tokens": -1}, "disagg_prefill_threshold_tokens must be >= 0, got -1"),
    ],
)
def test_the_router_config_says_what_it_said_before(change: dict[str, object], message: str) -> None:
    """The messages the hand-written checks gave, word for word."""
    with pytest.raises(ValueError) as raised:
        RouterConfig(**{"served_model_names": ("m",), "max_model_len": 64, **change})  # type: ignore[arg-type]
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("m", " "), "served_model_names must be non-empty names, got ('m', ' ')"),
        (("m", "m"), "served_model_names names a model twice: ('m', 'm')"),
    ],
)
def test_served_model_names_are_names_none_twice(names: tuple[str, ...], message: str) -> None:
    """The router's names and the gateway's own (--served-model-name, which may also be none: the --model's)."""
    for config in (lambda: RouterConfig(served_model_names=names, max_model_len=64),
                   lambda: GatewayConfig(served_model_names=names)):
        with pytest.raises(ValueError) as raised:
            config()
        assert str(raised.value) == message
    assert GatewayConfig().served_model_names == ()
