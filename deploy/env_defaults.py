"""Flags from the environment: every `--some-flag` of a command defaults to `$SPLITSERVE_SOME_FLAG` when set.

    SPLITSERVE_PREFILL_WORKERS=3 splitserve head ...     is    splitserve head --prefill-workers 3 ...

Precedence: a flag on the command line, then its environment variable, then the flag's own default. The value is
parsed as the flag would parse it (its `type`, its `choices`; a flag of several values takes the variable's
words); an on/off flag (`--x` / `--no-x`, or a bare
`--x`) takes 1/true/yes/on or 0/false/no/off. A bad value is a ValueError naming the variable, so the command
exits 2 with a clear message, as for a bad flag. Containers (the Helm chart) configure the commands this way.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

PREFIX = "SPLITSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(option: str) -> str:
    """`--prefill-workers` -> `SPLITSERVE_PREFILL_WORKERS`."""
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Set the defaults of `parser`'s long options from the environment (see the module docstring)."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:  # argparse has no public walk over its actions
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not longs or action.dest in ("help", "func"):
            continue
        name = env_name(longs[0])
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        parser.set_defaults(**{action.dest: _parse(action, name, raw)})


def _parse(action: argparse.Action, name: str, raw: str) -> object:
    if action.nargs == 0:  # store_true, store_false, BooleanOptionalAction
        value = raw.strip().lower()
        if value not in _TRUE + _FALSE:
            raise ValueError(f"${name} must be one of {'/'.join(_TRUE + _FALSE)}, got {raw!r}")
        on = value in _TRUE
        return (not on) if isinstance(action, argparse._StoreFalseAction) else on
    if action.nargs in ("+", "*"):  # a flag of several values (--served-model-name a b): the variable's words
        return [_value(action, name, word) for word in raw.split()]
    value = _value(action, name, raw)
    if isinstance(action, argparse._AppendAction):  # a repeatable flag (--api-key): the variable is one value
        return [value]
    return value


def _value(action: argparse.Action, name: str, raw: str) -> object:
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"${name}: {exc or 'invalid value'} (got {raw!r})") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"${name} must be one of {', '.join(map(str, action.choices))}, got {raw!r}")
    return value
