#!/usr/bin/env bash
# The test suite, as CI runs it: set up, then every test (the real-model ones included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/python -m pytest -q "$@"
