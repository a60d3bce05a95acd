"""The router tokenizes and never imports torch, so neither may the tokenizer package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_tokenizer_package_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import engine.tokenizer.tokenizer, engine.tokenizer.detokenizer\n"
        "import engine.tokenizer.gguf_spec, engine.tokenizer.hf_spec\n"
        "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"
