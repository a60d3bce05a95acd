#!/usr/bin/env bash
# Create .venv (if missing) and install splitserve with its test extras. Idempotent and quick when done before.
# torch==2.13.0 goes in first, alone: it is the CPU wheel, and installing it explicitly keeps pip from choosing
# a multi-GB CUDA build to satisfy the range in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.splitserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[test]"
  touch "$stamp"
fi
