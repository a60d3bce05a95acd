"""The router never imports torch or ray: it must start on any machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_router_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys\n"
        "import router, router.app, router.server, router.metrics, router.worker_registry, router.routing\n"
        "from router.server import build_router_app, load_tokenizer\n"
        "print(sorted(name for name in ('torch', 'ray', 'transformers') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "[]"
