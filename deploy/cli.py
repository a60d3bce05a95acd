"""The `splitserve` command. Subcommands import their heavy parts only when chosen."""

from __future__ import annotations

import argparse
import sys

from deploy.env_defaults import apply_env_defaults
from engine.loader.errors import ModelLoadError  # torch-free, like everything imported here
from worker.log_config import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    from deploy import gateway_command, head_command, scale_command, serve_command
    from deploy.bench import command as bench_command
    from deploy.planner import commands as planner_commands
    from engine import generate_command
    from engine.kernels import build_command

    generate_command.add_parser(sub)
    serve_command.add_parser(sub)
    head_command.add_parser(sub)
    gateway_command.add_parser(sub)
    scale_command.add_parser(sub)
    build_command.add_parser(sub)
    planner_commands.add_parsers(sub)  # profile, plan
    bench_command.add_parser(sub)
    apply_env_defaults(sub.choices["build-kernels"])  # SPLITSERVE_DRY_RUN=1, SPLITSERVE_ALL_VARIANTS=1
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # reads the SPLITSERVE_* defaults of head, gateway, build-kernels (deploy/env_defaults.py)
    except ValueError as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    configure_logging()
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, ModelLoadError) as exc:  # bad input: a clear message, no traceback
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
