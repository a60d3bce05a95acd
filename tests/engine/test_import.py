"""The engine is the inference library alone: none of it imports grpc or redis. Serving it over gRPC and publishing
its KV events to Redis is the worker process's (worker/); the offline `LLM`, the benchmarks and a tensor-parallel
rank import the engine without either."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE = REPO_ROOT / "engine"
# The process plumbing: the gRPC and Redis clients, and our modules that are gRPC links or services themselves.
PLUMBING = ("grpc", "redis", "protos.serving_pb2_grpc", "protos.kv_transfer_pb2_grpc", "protos.cluster_auth",
            "kv_transfer.grpc_link", "worker")


def imported_names(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import statement in the file, at module level or deferred inside a function."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:  # a relative import stays inside the engine
            yield node.lineno, node.module or ""
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def is_plumbing(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PLUMBING)


def test_no_engine_module_imports_grpc_or_redis() -> None:
    """Read from the source, every import statement: a deferred `import redis` counts as much as one at the top."""
    found = sorted({f"{path.relative_to(REPO_ROOT)}:{line}: {name}"
                    for path in ENGINE.rglob("*.py") for line, name in imported_names(path) if is_plumbing(name)})
    assert found == []


def test_every_engine_module_imports_with_grpc_and_redis_unimportable() -> None:
    """What the engine's modules import in turn (kv_transfer's, protos') pulls neither in either."""
    code = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['grpc'] = sys.modules['redis'] = None  # importing either raises ImportError\n"
        "import engine\n"
        "failed = []\n"
        "for info in pkgutil.walk_packages(engine.__path__, 'engine.'):\n"
        "    try:\n"
        "        importlib.import_module(info.name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(f'{info.name}: {exc}')\n"
        "print(failed)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=False, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
