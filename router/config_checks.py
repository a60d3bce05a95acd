"""Range checks declared on the fields of frozen config dataclasses, run once by `check_fields` in `__post_init__`.

    @dataclass(frozen=True, kw_only=True)
    class GatewayConfig:
        queue_timeout_s: float = checked(POSITIVE, default=30.0)
        max_queued_requests: int | None = checked(AT_LEAST_ZERO, default=None)     # None passes: "unbounded"
        routing_policy: str = checked(one_of(POLICIES), default="prefix-aware")

        def __post_init__(self) -> None:
            check_fields(self)          # FieldValueError: "queue_timeout_s must be positive, got 0.0"

A field states its default and its range in one place. The error names the field; a command that built the config
from its flags names the flag instead (`FieldValueError.field` and `.problem`: deploy/config_flags.py). A check
that spans fields (one bound under another) stays a line of `__post_init__`. No I/O, nothing heavy imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

_CHECK = "splitserve.check"  # the field metadata key


@dataclasses.dataclass(frozen=True)
class Check:
    """What a field's value must be: `holds(value)`; else the error says "<field> <says>, got <value>"."""

    holds: Callable[[Any], bool]
    says: str


POSITIVE = Check(lambda value: value > 0, "must be positive")  # NaN fails it, as `not value > 0` did
AT_LEAST_ZERO = Check(lambda value: value >= 0, "must be >= 0")
AT_LEAST_ONE = Check(lambda value: value >= 1, "must be at least 1")


def one_of(choices: Iterable[str]) -> Check:
    names = tuple(choices)
    return Check(lambda value: value in names, f"must be one of {', '.join(names)}")


def within(low: int, high: int) -> Check:
    return Check(lambda value: low <= value <= high, f"must be in {low}..{high}")


class FieldValueError(ValueError):
    """A config field's bad value: `field` names it, `problem` says what is wrong ("must be positive, got 0")."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


def checked(check: Check, *, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose values `check_fields` holds to `check` (None passes: it means "none" or "unbounded"
    where the field's type allows it). Without `default`, the field is required."""
    return dataclasses.field(default=default, metadata={_CHECK: check})


def check_fields(config: Any) -> None:
    """Raise FieldValueError for the first field of the dataclass `config` whose value fails its check."""
    for field in dataclasses.fields(config):
        check = field.metadata.get(_CHECK)
        value = getattr(config, field.name)
        if check is not None and value is not None and not check.holds(value):
            shown = repr(value) if isinstance(value, str) else value
            raise FieldValueError(field.name, f"{check.says}, got {shown}")
