#!/usr/bin/env bash
# The test suite, as CI runs it: set up, then every test (the real-model ones included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
# Two pytest-xdist workers, one test file at a time each (a file's module-scoped clusters and fixtures stay on one
# worker); `./deploy/test.sh -n 0` runs serially.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
