"""Regenerate the Python code for every `.proto` file in this folder.

    python -m protos.generate            # writes protos/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python -m protos.generate --out DIR  # writes under DIR/protos/ instead (the reproducibility test uses this)

The output depends only on the `.proto` files and the grpcio-tools version, which is pinned (GRPCIO_TOOLS_VERSION)
so that anyone regenerating gets byte-identical files; `tests/protos/test_generated.py` checks that.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
from pathlib import Path

GRPCIO_TOOLS_VERSION = "1.85.1"
PROTOS_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTOS_DIR.parent


def proto_files() -> list[Path]:
    return sorted(PROTOS_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile every proto into `out_root/protos/`; returns the files written."""
    from grpc_tools import protoc  # the test extra; never needed at run time

    found = version("grpcio-tools")
    if found != GRPCIO_TOOLS_VERSION:
        raise RuntimeError(f"protos are generated with grpcio-tools=={GRPCIO_TOOLS_VERSION}, found {found}")
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "protos").mkdir(exist_ok=True)
    # Paths relative to the repo root, so generated imports read `from protos import serving_pb2`.
    rels = [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{REPO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *rels]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {rels}")
    return sorted(p for p in (out_root / "protos").iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write protos/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
