#!/usr/bin/env bash
# The main job: set up, then serve SmolLM2-135M-Instruct (fetched on first use) with one prefill and one decode
# worker behind the OpenAI-compatible router on http://127.0.0.1:8000. Ctrl-C stops everything.
#
#   curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
#     -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
#
# Extra flags go to `splitserve serve` (e.g. --kv-transport inproc, --colocated, --port 8080).
# `python -m deploy.cli` is `splitserve`, run from the repository root so that every package imports even when
# the editable install predates one of them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/python -m deploy.cli serve --model smollm2-135m --prefill-workers 1 --decode-workers 1 --port 8000 "$@"
