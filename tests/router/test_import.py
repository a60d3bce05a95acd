"""The router never imports torch or ray: it must start on any machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = "print(sorted(name for name in ('torch', 'ray', 'transformers') if name in sys.modules))\n"


def _run(code: str) -> list[str]:
    """`code` in a fresh interpreter from the repository root; its stdout lines."""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()


def test_router_imports_neither_torch_nor_ray() -> None:
    lines = _run(
        "import sys\n"
        "import router, router.app, router.server, router.metrics, router.worker_registry, router.routing\n"
        "from router.server import build_router_app, load_tokenizer\n" + HEAVY
    )
    assert lines[-1] == "[]"


def test_a_dummy_shapes_gateway_loads_the_workers_tokenizer_without_torch() -> None:
    """`serve --load-format dummy --model llama-3.2-1b`: the gateway takes the shape's stand-in tokenizer (the one
    its workers use) and context length, and still never imports torch."""
    models, imported = _run(
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from router.server import build_router_app\n"
        "app = build_router_app(model='llama-3.2-1b', load_format='dummy', worker_provider=lambda: [])\n"
        "models = TestClient(app).get('/v1/models').json()\n"
        "print([m['id'] for m in models['data']], [m.get('max_model_len') for m in models['data']])\n" + HEAVY
    )[-2:]
    assert models == "['llama-3.2-1b'] [131072]"
    assert imported == "[]"
