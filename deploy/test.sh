#!/usr/bin/env bash
# The test suite, as CI runs it: set up, then every test (the real-model ones included), on two pytest-xdist
# workers that take whole test files (--dist loadfile: a module's fixtures, such as its cluster, stay in one
# process). Most of the suite's wall time is waiting (worker start-up, Ray, subprocesses), so two workers on two
# cores about halve it. Extra arguments go to pytest (`-n 0` runs serially, e.g. to debug one test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
