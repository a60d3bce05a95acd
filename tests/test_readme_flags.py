"""The README's flag tables against the commands' own argparse parsers: every flag a table documents exists, every
flag a parser takes is documented, and a plain default a table states is the parser's.

    README.md                                        parsers (introspected: their actions' option strings)
    ─────────                                        ───────
    a flag table: `| flag | default | meaning |`     deploy/cli.py's `splitserve` subcommands
    its flags: the backticked `--names` of its       `python -m prefill_worker` / `decode_worker`
    first column; named by the heading above it      (worker/main.py)
                       └──────── TABLES_OF: command → its tables ────────┘

A command's tables together document each of its flags exactly once; a row without a flag (`engine flags`)
refers to another table, which TABLES_OF lists for that command too. Every flag table of the README belongs to
some command, and every `splitserve` subcommand has its tables, so a new command or flag, a renamed heading or a
removed flag fails here, naming what to fix. Torch-free and Ray-free: building these parsers imports neither.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

ENGINE = "Engine flags (vLLM's names)"
SERVE = "`serve` flags"
# Each command and the headings of the tables that document its flags.
TABLES_OF: dict[str, tuple[str, ...]] = {
    "splitserve serve": (SERVE, "Autoscaling", ENGINE),
    "splitserve gateway": ("`splitserve gateway`",),
    "splitserve head": ("`splitserve head`", ENGINE),
    "splitserve scale": ("`splitserve scale`",),
    "splitserve build-kernels": ("`splitserve build-kernels`",),
    "splitserve generate": ("`splitserve generate`", ENGINE),
    "splitserve profile": ("`splitserve profile`", ENGINE),
    "splitserve plan": ("`splitserve plan`",),
    "splitserve bench": ("`splitserve bench`",),
    "python -m prefill_worker": ("`python -m prefill_worker`, `python -m decode_worker`", ENGINE),
    "python -m decode_worker": ("`python -m prefill_worker`, `python -m decode_worker`", ENGINE),
}
# The worker entry points' roles, as their __main__ modules pass them (those import torch: not imported here).
WORKER_ROLES = {"python -m prefill_worker": ("prefill",), "python -m decode_worker": ("decode", "colocated")}

_HEADER = ["flag", "default", "meaning"]
_FLAG_NAME = r"--[a-z0-9][a-z0-9-]*"
_FLAG = re.compile(f"`({_FLAG_NAME})`")
_BACKTICKED_DASHES = re.compile(r"`(--[^`]*)`")


@dataclass(frozen=True)
class Row:
    flags: tuple[str, ...]  # in the order written, `--no-x` forms included
    default: str
    line: int  # 1-based, in README.md


@dataclass(frozen=True)
class FlagTable:
    heading: str
    line: int  # its header's, 1-based
    rows: tuple[Row, ...]

    @property
    def flags(self) -> list[str]:
        return [flag for row in self.rows for flag in row.flags]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def read_flag_tables(text: str) -> Iterator[FlagTable]:
    """Every `| flag | default | meaning |` table of `text`, with the heading it sits under (outside fenced code).
    Raises AssertionError on a first cell with a backticked `--` token that is not a bare flag name."""
    heading, in_fence = "", False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif not in_fence and line.startswith("|") and _cells(line) == _HEADER:
            start, rows = i + 1, []
            i += 2  # the header and its `| --- |` line
            while i < len(lines) and lines[i].startswith("|"):
                first, default = _cells(lines[i])[:2]
                flags = tuple(_FLAG.findall(first))
                malformed = [t for t in _BACKTICKED_DASHES.findall(first) if not re.fullmatch(_FLAG_NAME, t)]
                assert not malformed, f"README.md:{i + 1}: write each flag of the first column as `--name`: {malformed}"
                rows.append(Row(flags=flags, default=default, line=i + 1))
                i += 1
            yield FlagTable(heading=heading, line=start, rows=tuple(rows))
            continue
        i += 1


# -- the parsers -------------------------------------------------------------------------------------------------
class _Parsed(Exception):
    """Carries the parser an entry point built, in place of its parse."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _worker_parser(roles: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser `parse_worker_config` builds (it builds and parses in one call: its parse is intercepted)."""
    from worker import main as worker_main

    def intercept(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        raise _Parsed(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", intercept)
        try:
            worker_main.parse_worker_config([], roles)
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError("parse_worker_config built no parser")


def _flags_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions  # argparse has no public walk over its actions
            if not isinstance(action, argparse._HelpAction) for option in action.option_strings}


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, built with no SPLITSERVE_* variable set (`head` and `gateway` take their defaults
    from the environment: deploy/env_defaults.py), so the defaults are the code's own."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("SPLITSERVE_")]:
            patch.delenv(name)
        from deploy.cli import build_parser

        (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
        built = {f"splitserve {name}": parser for name, parser in subparsers.choices.items()}
        built.update({command: _worker_parser(roles) for command, roles in WORKER_ROLES.items()})
    return built


@pytest.fixture(scope="module")
def tables() -> list[FlagTable]:
    return list(read_flag_tables(README.read_text()))


# -- the tests ---------------------------------------------------------------------------------------------------
def test_every_command_has_its_tables_and_every_table_its_command(parsers: dict[str, argparse.ArgumentParser],
                                                                   tables: list[FlagTable]) -> None:
    assert set(parsers) == set(TABLES_OF), (
        f"commands without flag tables in TABLES_OF: {sorted(set(parsers) - set(TABLES_OF))}; "
        f"in TABLES_OF but no such command: {sorted(set(TABLES_OF) - set(parsers))}")
    headings = [t.heading for t in tables]
    wanted = {h for hs in TABLES_OF.values() for h in hs}
    problems = [f"no flag table under the heading {h!r}" for h in sorted(wanted - set(headings))]
    problems += [f"more than one flag table under {h!r}" for h in sorted(wanted) if headings.count(h) > 1]
    problems += [f"README.md:{t.line}: the flag table under {t.heading!r} belongs to no command (TABLES_OF)"
                 for t in tables if t.heading not in wanted]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", sorted(TABLES_OF))
def test_the_readme_documents_each_flag_of_the_command_once(command: str, parsers: dict[str, argparse.ArgumentParser],
                                                             tables: list[FlagTable]) -> None:
    by_heading = {t.heading: t for t in tables}
    documented = [flag for heading in TABLES_OF[command] if heading in by_heading
                  for flag in by_heading[heading].flags]
    taken = set(_flags_of(parsers[command]))
    missing = sorted(taken - set(documented))
    extra = sorted(set(documented) - taken)
    twice = sorted({flag for flag in documented if documented.count(flag) > 1})
    problems = [f"  {flag}: taken, not documented" for flag in missing]
    problems += [f"  {flag}: documented, not taken (remove it from the README)" for flag in extra]
    problems += [f"  {flag}: documented more than once" for flag in twice]
    where = " + ".join(repr(h) for h in TABLES_OF[command])
    assert not problems, f"{command} against the README's tables {where}:\n" + "\n".join(problems)


def _stated(value: object, text: str) -> bool | None:
    """Whether `text` (a table's default, one flag's part) states `value`; None when it is not a plain value
    (prose, a variable, "none") and says nothing checkable."""
    text = text.strip().strip("`")
    if not re.fullmatch(r"[\w.:/-]+", text) or text in ("none", "required"):
        return None
    if isinstance(value, bool):
        return {"on": True, "off": False}.get(text) == value
    if isinstance(value, (int, float)):
        try:
            return float(text) == value
        except ValueError:
            return False
    return text == value if isinstance(value, str) else None


@pytest.mark.parametrize("command", sorted(TABLES_OF))
def test_a_plain_default_in_the_readme_is_the_parsers(command: str, parsers: dict[str, argparse.ArgumentParser],
                                                       tables: list[FlagTable]) -> None:
    """A row's default cell, split at ", " into one part per flag (`--no-x` forms aside), is checked where a part
    is a plain value and the parser's default is not None (a None default is resolved later: "pool's slots")."""
    actions = _flags_of(parsers[command])
    by_heading = {t.heading: t for t in tables}
    wrong = []
    for heading in TABLES_OF[command]:
        for row in by_heading[heading].rows if heading in by_heading else ():
            flags = [f for f in row.flags if not f.startswith("--no-")]
            parts = row.default.split(", ")
            if len(parts) != len(flags):
                continue
            for flag, part in zip(flags, parts, strict=True):
                action = actions.get(flag)
                if action is None or action.default is None or action.required:
                    continue
                if _stated(action.default, part) is False:
                    wrong.append(f"README.md:{row.line}: {command} {flag}: the README says {part!r}, the parser's "
                                 f"default is {action.default!r}")
    assert not wrong, "\n".join(wrong)


def test_the_tables_are_read_as_written() -> None:
    """The reader on a small page: headings, fences, `--no-x` forms, rows without flags, a malformed flag cell."""
    page = "\n".join([
        "### `x` flags", "", "```", "# not a heading", "| flag | default | meaning |", "```",
        "| flag | default | meaning |", "| --- | --- | --- |",
        "| `--a`, `--b` | 1, 2 | two |", "| `--c` / `--no-c` | on | a switch |", "| engine flags | | see below |",
        "", "## Other", "| flag | default | meaning |", "| --- | --- | --- |", "| `--d` | none | |",
    ])
    tables = list(read_flag_tables(page))
    assert [(t.heading, t.flags) for t in tables] == [("`x` flags", ["--a", "--b", "--c", "--no-c"]),
                                                      ("Other", ["--d"])]
    assert [r.default for r in tables[0].rows] == ["1, 2", "on", ""]
    with pytest.raises(AssertionError, match="--grpc-tls-cert/key"):
        list(read_flag_tables("# h\n| flag | default | meaning |\n| --- | --- | --- |\n| `--grpc-tls-cert/key` | | |"))
    assert [_stated(v, t) for v, t in [(30.0, "30"), (True, "on"), (False, "on"), ("grpc", "grpc"), (8000, "auto"),
                                       (3, "pool's slots"), (None, "none")]] == [True, True, False, True, False, None,
                                                                                   None]
