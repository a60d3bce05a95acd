"""`splitserve build-kernels`: compile the C++ CPU kernels into the kernel cache ahead of serving.

`deploy/setup.sh` runs it (this CPU's variant), `serve` runs it before any worker starts (unless it recorded
every kernel built: native_build.recorded_ready), and an image build
(deploy/docker/) runs it with `--all-variants` (every variant, so the image runs on CPUs other than the builder's).
`--dry-run` lists the builds it would run, one line each, and compiles nothing. Every flag may come from the
environment (`SPLITSERVE_ALL_VARIANTS=1`, `SPLITSERVE_DRY_RUN=1`; deploy/cli.py applies deploy/env_defaults.py), so
a test can run an image's build steps, setup.sh included, as dry runs. Exit status 0 when every build asked for is
in place (or this CPU fits no variant: its torch ops run), 1 when a build failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

DRY_RUN_LINE = "{module} ({variant}): would build"  # --dry-run's line per build, which tests read


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build-kernels", help="compile the C++ CPU kernels ahead of serving")
    p.add_argument("--all-variants", action="store_true",
                   help="build every variant (x86-64-v3, x86-64-v4), not only the one this CPU loads")
    p.add_argument("--dry-run", action="store_true",
                   help="list the builds this command would run (module, variant) and the cache; compile nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.kernels.registry import native_modules
    from kv_transfer import native_build

    if args.all_variants:
        variants = list(native_build.VARIANTS)
    else:
        variant, reason = native_build.selected_variant()
        if variant is None:
            print(f"splitserve: no C++ CPU kernels to build: {reason}", file=sys.stderr)
            return 0
        variants = [variant]
    print(f"kernel cache: {native_build.cache_root()}", flush=True)
    jobs = [(module, variant) for variant in variants for module in native_modules()]
    if args.dry_run:
        for module, variant in jobs:
            print(DRY_RUN_LINE.format(module=module.name, variant=variant.name), flush=True)
        return 0
    # A build is one single-threaded compiler run: one per core at once.
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        futures = [pool.submit(native_build.build, module, variant) for module, variant in jobs]
    num_failed = 0
    builds = []
    for (module, variant), future in zip(jobs, futures, strict=True):
        try:
            result = future.result()
        except (native_build.NativeBuildError, OSError) as exc:  # OSError: a cache folder we cannot write
            num_failed += 1
            print(f"{module.name} ({variant.name}): FAILED: {exc}", flush=True)
            continue
        builds.append(result.path.parent)
        done = f"built in {result.build_s:.1f} s" if result.built else "already built"
        print(f"{module.name} ({variant.name}): {done} ({result.path.parent.name})", flush=True)
    if not num_failed and not args.all_variants:  # what this CPU loads, all built: serve need not ask again
        native_build.record_ready(builds)
    return 1 if num_failed else 0
