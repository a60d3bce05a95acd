#!/usr/bin/env bash
# The test suite, as CI runs it: set up, then every test (the real-model ones included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
# Two pytest-xdist workers, each taking a test file at a time, except that the files starting a Ray cluster run on
# one worker, one after another, handed out first (tests/xdist_scheduler.py); `./deploy/test.sh -n 0` runs serially.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
