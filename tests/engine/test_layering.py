"""The engine's import layering: its modules stand on floors, each importing only from its own floor and the
floors below, with no import circle; and the request contract (engine/request/) imports no torch.

Imports are read from the source with `ast`, every import statement in a file: module level, inside functions and
under `if TYPE_CHECKING:` alike (a deferred import still ties the two modules together for a reader).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE = REPO_ROOT / "engine"

# Lowest first. A module's floor is that of its top-level name under engine/ (engine.core.scheduler: engine.core).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contract", ("engine.request", "engine.config")),  # what a request asks for; how an engine is configured
    ("base", ("engine.kernels", "engine.tokenizer", "engine.huge_pages", "engine.device",
              "engine.host_copy")),
    ("control plane", ("engine.core", "engine.outputs", "engine.output_processor", "engine.kv_blocks")),
    ("model", ("engine.attention", "engine.model", "engine.kv_cache_dtype", "engine.cuda_graphs", "engine.loader",
               "engine.lora")),
    ("sampling", ("engine.structured", "engine.sampling")),
    ("runner", ("engine.model_runner", "engine.launched_step", "engine.memory_profile", "engine.spec_decode",
                "engine.input_processor", "engine.distributed", "engine.kv_tier_blocks",
                "engine.kv_peer_blocks")),
    ("engine", ("engine.llm_engine", "engine.engine_builder", "engine.llm", "engine.engine_args")),
    ("entry points", ("engine.generate_command", "engine")),
)
# The contract is imported by the router, which never imports torch: it stands on nothing else of the engine.
CONTRACT_MAY_IMPORT = ("engine.request", "protos")


def engine_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ENGINE.rglob("*.py")):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every dotted name an import statement in the file names: `from a.b import c` gives a.b.c and a.b."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, base] if base else parents)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def engine_imports() -> dict[str, set[str]]:
    """module -> the other engine modules it imports (a name resolves to the longest module it starts with)."""
    modules = engine_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {resolve(name) for name in imported_names(module, path)}
        edges[module] = {target for target in targets if target is not None and target != module}
    return edges


def floor_of(module: str) -> int:
    top = ".".join(module.split(".")[:2])
    for index, (_, members) in enumerate(FLOORS):
        if top in members:
            return index
    raise LookupError(module)


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_every_engine_module_stands_on_a_floor() -> None:
    unplaced = []
    for module in engine_modules():
        try:
            floor_of(module)
        except LookupError:
            unplaced.append(module)
    assert not unplaced, f"place these in FLOORS (tests/engine/test_layering.py): {unplaced}"


def test_no_import_runs_up_a_floor() -> None:
    upward = sorted(
        f"{module} ({FLOORS[floor_of(module)][0]}) -> {target} ({FLOORS[floor_of(target)][0]})"
        for module, targets in engine_imports().items()
        for target in targets
        if floor_of(target) > floor_of(module)
    )
    assert not upward, "imports up a floor:\n" + "\n".join(upward)


def test_no_import_cycle_within_the_engine() -> None:
    assert import_cycles(engine_imports()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(edges) == [["a", "b", "c"]]


def test_the_contract_stands_on_nothing_else_of_the_engine() -> None:
    modules = engine_modules()
    assert "engine.request.sampling_params" in modules
    outside = sorted(
        f"{module} -> {name}"
        for module, path in modules.items()
        if module.startswith("engine.request")
        for name in imported_names(module, path)
        if name.split(".")[0] in ("engine", "kv_transfer", "router", "deploy")
        and not name.startswith(CONTRACT_MAY_IMPORT)
    )
    assert not outside, outside


def test_the_contract_and_the_control_plane_import_no_torch() -> None:
    """engine/request (the router imports it) and engine/core: imported in a fresh interpreter, torch stays out."""
    modules = [m for m in engine_modules() if m.startswith(("engine.request", "engine.core"))]
    assert "engine.request.sampling_params" in modules and "engine.core.scheduler" in modules
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "print(sorted(name for name in ('torch', 'numpy', 'xgrammar') if name in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
