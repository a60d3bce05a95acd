"""Every Triton kernel compiles for sm_90 (H100) through the real compiler, on a machine with no GPU.

The interpreter tests check the arithmetic; this checks what only the compiler refuses. It runs in a child
process because this pytest process may have TRITON_INTERPRET=1 (see conftest.py), under which @triton.jit
compiles nothing. bfloat16 only, the dtype a GPU serves in (~10 s from a cold Triton cache on 2 busy cores, ~3 s
warm); `python -m engine.kernels.triton.compile_check` checks float32 and float16 too (another ~35 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_in_bfloat16():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "engine.kernels.triton.compile_check", "--arch", "90", "--dtypes", "bf16"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sm_90: all compile" in result.stdout
