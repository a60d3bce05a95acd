#!/usr/bin/env bash
# The main job: set up, fetch SmolLM2-135M-Instruct on first use, and generate with the in-process engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/splitserve generate --model smollm2-135m --chat --temperature 0 --max-tokens 64 \
  --prompt "What is the capital of France?" \
  --prompt "Write a haiku about paged attention." "$@"
