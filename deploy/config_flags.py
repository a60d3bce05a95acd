"""Command-line flags that set the fields of a frozen config dataclass: a flag names its field and takes the
field's default; a bad value fails the field's own check (router/config_checks.py), said with the flag's name.

    QUEUE_TIMEOUT = ConfigFlag("--queue-timeout", "queue_timeout_s", "seconds a request may wait ...", type=float)
    add_config_flags(parser, GatewayConfig, [QUEUE_TIMEOUT, ...])    # argparse: --queue-timeout, default 30.0
    config = config_from_flags(GatewayConfig, [QUEUE_TIMEOUT, ...], args, **fields_set_otherwise)
        --queue-timeout 0  ->  ValueError("--queue-timeout must be positive, got 0.0")

So a setting is written twice, the flag and the field, and its default once. A flag's argparse name (`dest`) is
the usual one, from its option (`queue_timeout`), so `SPLITSERVE_QUEUE_TIMEOUT` (deploy/env_defaults.py) and the
README's tables (tests/test_readme_flags.py) see plain argparse flags. No I/O.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from router.config_checks import FieldValueError

C = TypeVar("C")


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    """`option` (a long flag) sets the config field `field`; `type`, `action`, `choices`, `nargs` as argparse takes
    them (a flag of several values sets a tuple field)."""

    option: str
    field: str
    help: str
    type: Callable[[str], Any] | None = None
    action: str | type[argparse.Action] | None = None
    choices: Sequence[str] | None = None
    nargs: str | None = None

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")


def json_string_list(text: str) -> tuple[str, ...]:
    """An argparse `type`: a JSON list of strings (vLLM's form for list flags: '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r} (e.g. '[\"https://a.example\"]')")
    return tuple(value)


def field_default(config_class: type, name: str) -> Any:
    """The default of `config_class`'s field `name` (its factory's value for a mutable one)."""
    (field,) = [f for f in dataclasses.fields(config_class) if f.name == name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ValueError(f"{config_class.__name__}.{name} has no default for a flag to take")


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_class: type,
                     flags: Iterable[ConfigFlag]) -> None:
    """Add each flag to `parser`, defaulting to its field's default."""
    for flag in flags:
        options = {name: value for name, value in (("type", flag.type), ("action", flag.action),
                                                    ("choices", flag.choices), ("nargs", flag.nargs))
                   if value is not None}
        parser.add_argument(flag.option, default=field_default(config_class, flag.field), help=flag.help, **options)


def config_from_flags(config_class: type[C], flags: Iterable[ConfigFlag], args: argparse.Namespace,
                      **fields: Any) -> C:
    """`config_class` with each flag's value in its field and `fields` (set otherwise: from several flags, from
    the environment) over them. A field's failed check is a ValueError naming its flag ("--x must be ...")."""
    flags = tuple(flags)
    try:
        return config_class(**{**{flag.field: _value(flag, args) for flag in flags}, **fields})
    except FieldValueError as exc:
        option = next((flag.option for flag in flags if flag.field == exc.field), None)
        if option is None:
            raise
        raise ValueError(f"{option} {exc.problem}") from None


def _value(flag: ConfigFlag, args: argparse.Namespace) -> Any:
    value = getattr(args, flag.dest)
    return tuple(value) if flag.nargs is not None and isinstance(value, list) else value
