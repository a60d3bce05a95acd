#!/usr/bin/env bash
# What a lent GPU session carries to the device machine, made here before any device time is spent:
#
#     bash bench/gpu_prepare.sh [--old REV]
#
#   .whl/                        the wheels the engine needs and the device machine lacks (it has torch, triton and
#                                transformers, and no network): this venv's versions of crc32c, gguf, protobuf, grpcio,
#                                xgrammar and what xgrammar needs beyond those, for CPython 3.12 on manylinux x86-64.
#                                bench/gpu_session.sh installs them into /tmp/site.
#   gpu-carry/smollm2-tokenizer  the SmolLM2 tokenizer as an HF directory (tokenizer.json): the structured-outputs
#                                phase runs dummy weights with the real tokenizer.
#   gpu-carry/old                with --old REV: `git archive` of REV, for a phase that measures the code before
#                                a change against after (bench/gpu_session.sh's handoff_before).
#
# Both folders are git-ignored: name them in the device call's carry (".whl", "gpu-carry"). Then, on the device:
# `bash bench/gpu_session.sh` (docs/benchmarks.md, "GPU"; smoke-test it here first with
# SPLITSERVE_GPU_SESSION_SMOKE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OLD=""
while [ $# -gt 0 ]; do
    case "$1" in
        --old) OLD=$2; shift 2 ;;
        *) echo "usage: bash bench/gpu_prepare.sh [--old REV]" >&2; exit 2 ;;
    esac
done

# The same versions as here, so the device runs what the suite tested.
mapfile -t PINS < <("$PY" - <<'PY'
import importlib.metadata as metadata
for name in ("crc32c", "gguf", "protobuf", "grpcio", "xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core",
             "annotated-types", "typing-inspection"):
    print(f"{name}=={metadata.version(name)}")
PY
)
rm -rf .whl
mkdir -p .whl gpu-carry
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${PINS[@]}"
echo "wheels: $(ls .whl | wc -l) in .whl ($(du -sh .whl | cut -f1)): ${PINS[*]}"

TOKENIZER=gpu-carry/smollm2-tokenizer
if [ ! -f "$TOKENIZER/tokenizer.json" ]; then
    "$PY" - "$TOKENIZER" <<'PY'
import os
import sys

from transformers import AutoTokenizer

from engine.loader.model_registry import resolve_model

directory, name = os.path.split(str(resolve_model("smollm2-135m")))
AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(sys.argv[1])
PY
fi
"$PY" -c "import sys; from engine.tokenizer.tokenizer import Tokenizer; Tokenizer.from_hf_dir(sys.argv[1])" "$TOKENIZER"
echo "tokenizer: $TOKENIZER ($(du -sh "$TOKENIZER" | cut -f1))"

if [ -n "$OLD" ]; then
    rm -rf gpu-carry/old
    mkdir -p gpu-carry/old
    git archive "$OLD" | tar -x -C gpu-carry/old
    echo "old code: gpu-carry/old ($(git rev-parse --short "$OLD"))"
fi
echo "carry: .whl gpu-carry ($(du -shc .whl gpu-carry | tail -1 | cut -f1) of the 64 MiB a call carries)"
