#!/usr/bin/env bash
# Create .venv (if missing), install splitserve with its test extras (and, for those, AIPerf in .venv-aiperf and
# Chromium: see below), and build the C++ CPU kernels for this machine (into ~/.cache/splitserve/kernels). Idempotent and quick when done before.
# torch==2.13.0 goes in first, alone: it is the CPU wheel, and installing it explicitly keeps pip from choosing
# a multi-GB CUDA build to satisfy the range in pyproject.toml.
# The images (deploy/docker/) run this very script, with three knobs: SPLITSERVE_EXTRAS (default "test"; the
# images install none), SPLITSERVE_TORCH (default "torch==2.13.0") and SPLITSERVE_TORCH_INDEX_URL (default: PyPI;
# the images name PyTorch's CPU or CUDA wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${SPLITSERVE_EXTRAS-test}
TORCH=${SPLITSERVE_TORCH:-torch==2.13.0}
TORCH_INDEX=()
if [ -n "${SPLITSERVE_TORCH_INDEX_URL:-}" ]; then TORCH_INDEX=(--index-url "$SPLITSERVE_TORCH_INDEX_URL"); fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.splitserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "${TORCH_INDEX[@]}" "$TORCH"
  .venv/bin/python -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
  touch "$stamp"
fi
# Nothing compiles on the request path: the kernels are built here, once per machine. Without a compiler the
# engine runs its torch ops instead (slower, same results), so a failed build warns but does not stop set-up.
# The build (~100 CPU-s on a fresh machine) runs in the background while AIPerf and Chromium download and install.
.venv/bin/python -m deploy.cli build-kernels &
kernels_pid=$!
# `splitserve bench` drives AIPerf, which is no dependency of splitserve (its own venv, .venv-aiperf, pinned to the
# version the bench was written against), and its test checks the HTML report in headless Chromium (Debian's
# chromium and chromium-driver, through apt-get as root). Only with the test extras; what cannot be installed
# warns here, and those tests skip saying so.
if [[ ",$EXTRAS," == *",test,"* ]]; then
  if [ ! -x .venv-aiperf/bin/aiperf ]; then
    { "$PYTHON" -m venv .venv-aiperf && .venv-aiperf/bin/python -m pip install --quiet "aiperf==0.13.0"; } \
      || echo "setup: AIPerf did not install into .venv-aiperf (see above); splitserve bench's tests will skip" >&2
  fi
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
        || echo "setup: chromium did not install (see above); the bench report's browser test will skip" >&2
    else
      echo "setup: no chromium/chromedriver, and no root to apt-get them; the bench report's browser test will skip" >&2
    fi
  fi
fi
wait "$kernels_pid" \
  || echo "setup: the C++ CPU kernels did not build (see above); the engine will run its torch ops" >&2
