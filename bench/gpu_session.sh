#!/usr/bin/env bash
# One lent GPU session's measurements and tests, run once from the repository root:
#
#     bash bench/gpu_session.sh [PHASE ...]        # no PHASE: every phase, in the order below
#
# Each phase is time-boxed (a phase that runs over is killed and the next one starts) and writes its figures
# under $OUT (default ./gpu-out): session.log (everything printed), and one JSON per benchmark. Wheels the engine
# needs and the machine lacks travel in .whl/ (docs/benchmarks.md, "GPU"); they are installed to /tmp/site.
# The order puts the figures first and the broad test sweep last, so a session cut short keeps the
# figures. `SPLITSERVE_GPU_SESSION_SMOKE=1` runs every phase at toy sizes (on CPU too), to check the script.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 SPLITSERVE_DISABLE_CPU_KERNELS=1 PIP_NO_INDEX=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && [ -z "${SPLITSERVE_GPU_SESSION_SMOKE:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "!!! wheel install failed"
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
PY=${PYTHON:-python3}
SMOKE=${SPLITSERVE_GPU_SESSION_SMOKE:-}
DEVICE=cuda
[ -n "$SMOKE" ] && DEVICE=${SPLITSERVE_GPU_SESSION_DEVICE:-cpu}

# Every phase ends by SPLITSERVE_GPU_SESSION_DEADLINE_S seconds after the script began (default 560: a call's
# 600 s less the wheels and the return); a phase that would get under 15 s is skipped, to run in a later call.
SESSION_START=$(date +%s)
DEADLINE_S=${SPLITSERVE_GPU_SESSION_DEADLINE_S:-560}
phase() {  # phase NAME LIMIT_S command...
    local name=$1 limit=$2 start rc left
    shift 2
    left=$(( DEADLINE_S - ($(date +%s) - SESSION_START) ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
        echo "=== $name: SKIPPED (${left}s left of the session's ${DEADLINE_S}s)"
        FAILED+=" $name(skipped)"
        return
    fi
    echo "=== $name: start $(date +%T), limit ${limit}s: $*"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@"
    rc=$?
    echo "=== $name: rc=$rc after $(( $(date +%s) - start ))s"
    FAILED+=$([ $rc -ne 0 ] && echo " $name" || true)
}
FAILED=""

ENV_INFO='nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; "$0" -c "import sys, torch, \
triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0) \
if torch.cuda.is_available() else \"no cuda\")"'

if [ -n "$SMOKE" ]; then
    GPU_ARGS=(--device "$DEVICE" --shapes smollm2-135m --batches 1,2 --context 64 --steps 3 --warmup-steps 1
              --prefill-prompts 1 --hf-batch 2 --hf-prompt-len 8 --hf-new-tokens 4)
    DISAGG_ARGS=(--num-requests 2 --rounds 2 --warmup 1 --prompt-tokens 64 --max-tokens 4 --num-threads 1)
    DISAGG_TRANSPORTS=grpc
    STRUCTURED_ARGS=(--batch-sizes 1,2 --max-tokens 8 --repeats 1)
    HANDOFF_TRANSPORTS=grpc,inproc HANDOFF_REPEATS=2
else
    GPU_ARGS=(--device cuda --steps 20 --warmup-steps 3)
    DISAGG_ARGS=(--num-requests ${DISAGG_REQUESTS:-12} --rounds 4 --warmup 3)
    DISAGG_TRANSPORTS=grpc,ipc
    STRUCTURED_ARGS=(--max-tokens 96 --repeats 2)
    HANDOFF_TRANSPORTS=grpc,ipc,ipc-grpc,inproc HANDOFF_REPEATS=${HANDOFF_REPEATS:-20}
fi
# This session's new GPU tests, first: a failure here is what the run is for
# (the engine's GPU tests and the decode graphs' too: the forward, the sampler and the step loop changed under them)
NEW_TESTS=(tests/engine/structured/test_fill_ahead_gpu.py tests/engine/kernels/test_triton_rotary_store_kv.py
           tests/engine/kernels/test_triton_fused_forward.py tests/engine/kernels/test_triton_rms_norm.py
           tests/bench/test_kernel_count.py tests/kv_transfer/test_device_digest.py tests/kv_transfer/test_staging_pool.py
           tests/kv_transfer/test_grpc_staging.py tests/kv_transfer/test_inproc_digest.py tests/engine/test_gpu_engine.py
           tests/engine/kernels/test_decode_graphs.py)
NEW_TRANSPORT_TESTS=(tests/kv_transfer/test_ipc_transport.py tests/kv_transfer/test_transport_conformance.py)
# Issue 34's quantized kernels and engine on the GPU, issue 33's TP engine on CUDA (over gloo on one GPU)
QUANT_TESTS=(tests/engine/kernels/test_triton_quantized_linear.py tests/engine/kernels/test_cuda_quantized_linear.py
             tests/engine/kernels/test_weight_only_gemv.py tests/engine/test_gpu_quantization.py)
TP_TESTS=(tests/engine/distributed/test_tensor_parallel_cuda.py)
export SPLITSERVE_GPU_FIGURES=$OUT/gpu_figures.jsonl

run_phase() {
    case $1 in
    env) phase env 30 bash -c "$ENV_INFO" "$PY" ;;
    gpu) phase gpu 210 $PY bench/gpu.py "${GPU_ARGS[@]}" --json "$OUT/gpu.json" ;;
    disagg) phase disagg 110 $PY bench/disagg_overhead.py --device "$DEVICE" --load-format dummy \
        --transports "$DISAGG_TRANSPORTS" --skip-throughput "${DISAGG_ARGS[@]}" --json "$OUT/disagg.json" ;;
    structured) phase structured 90 $PY bench/structured.py --device "$DEVICE" --load-format dummy \
        --tokenizer gpu-carry/smollm2-tokenizer "${STRUCTURED_ARGS[@]}" --json "$OUT/structured.json" ;;
    handoff) phase handoff 45 $PY bench/handoff_cost.py --device "$DEVICE" --transports "$HANDOFF_TRANSPORTS" \
        --repeats "$HANDOFF_REPEATS" --json "$OUT/handoff.json" ;;
    handoff_before)  # the same bench over the code before this session's handoff work (gpu-carry/old: git archive)
        cp bench/handoff_cost.py gpu-carry/old/bench/handoff_cost.py
        (cd gpu-carry/old && PYTHONPATH="${PYTHONPATH/$PWD/$PWD/gpu-carry/old}" phase handoff_before 35 \
            $PY bench/handoff_cost.py --device "$DEVICE" --transports "$HANDOFF_TRANSPORTS" \
            --repeats "$HANDOFF_REPEATS") ;;
    grpcdiag)  # where a gRPC handoff's time goes inside the workers (their DEBUG stage lines), async on and off
        for mode in --async-scheduling --no-async-scheduling; do
            SPLITSERVE_LOGGING_LEVEL=DEBUG phase "grpcdiag$mode" 45 $PY bench/disagg_overhead.py --device "$DEVICE" \
                --load-format dummy --transports grpc --skip-throughput --num-requests 5 --warmup 2 \
                --worker-arg="$mode" 2> >(grep "KV handoff" | tail -n 14 >&2)
        done ;;
    quicktests)  # the new forward (fused rotary + store) and async scheduling against eager / synchronous
        phase quicktests 70 $PY -m pytest -q -m gpu -p no:cacheprovider tests/engine/kernels/test_triton_fused_forward.py \
            tests/engine/kernels/test_triton_rotary_store_kv.py \
            tests/engine/test_gpu_engine.py::test_async_scheduling_gives_the_synchronous_tokens_with_cuda_graphs ;;
    newtests)
        phase newtests 100 $PY -m pytest -q -m gpu -p no:cacheprovider "${NEW_TESTS[@]}"
        phase newtests_transports 60 $PY -m pytest -q -m gpu -p no:cacheprovider "${NEW_TRANSPORT_TESTS[@]}" \
            -k "(cuda or on_a_gpu) and not dying" ;;
    quanttests) phase quanttests 120 $PY -m pytest -q -p no:cacheprovider "${QUANT_TESTS[@]}" ;;
    gemvtests) phase gemvtests 60 $PY -m pytest -q -p no:cacheprovider tests/engine/kernels/test_weight_only_gemv.py ;;
    tptests) phase tptests 240 $PY -m pytest -q -p no:cacheprovider "${TP_TESTS[@]}" ;;
    quant_*)  # bench/gpu.py --quantization METHOD: bf16 and METHOD engines on the Llama-1B shape, batch 1 and 256
        local method=${1#quant_}
        if [ -n "$SMOKE" ]; then QUANT_ARGS=("${GPU_ARGS[@]}"); [ "$method" = fp8 ] && method=int8
        else QUANT_ARGS=(--device cuda --shapes llama-3.2-1b --batches 1,256 --steps 20 --warmup-steps 3); fi
        phase "quant_$method" 100 $PY bench/gpu.py "${QUANT_ARGS[@]}" --quantization "$method" --async-scheduling on \
            --json "$OUT/gpu-$method.json" ;;
    hosttier)  # issue 35: the host-memory tier's load time per block against recomputing it (the disk tier too)
        if [ -n "$SMOKE" ]; then
            phase hosttier 100 $PY bench/kv_tier_load.py --device "$DEVICE" --tier disk --shape smollm2-135m \
                --prompt-tokens 64 --rounds 1 --json "$OUT/tier-disk.json"
        else
            phase hosttier 60 $PY bench/kv_tier_load.py --device cuda --tier host --json "$OUT/tier-host.json"
            phase disktier 60 $PY bench/kv_tier_load.py --device cuda --tier disk --json "$OUT/tier-disk.json"
        fi ;;
    gemv)  # decode's GEMMs at 1 and 4 rows: bf16 cuBLAS, the quantized paths, the weight-only GEMV's tiles
        if [ -n "$SMOKE" ]; then echo "=== gemv: SKIPPED (a GPU benchmark)"; return; fi
        phase gemv 120 $PY bench/quantized_gemv.py --json "$OUT/gemv.json" ;;
    hf)  # against HF generate at batch 32 on the SmolLM2 shape (issue 38's >= 50x)
        local args=("${GPU_ARGS[@]}")
        [ -z "$SMOKE" ] && args=(--device cuda --shapes smollm2-135m --batches 32 --steps 20 --warmup-steps 3)
        phase hf 100 $PY bench/gpu.py "${args[@]}" --skip-prefill --async-scheduling on --kernel-count-batches '' \
            --json "$OUT/gpu-hf.json" ;;
    step256)  # the decode step with the kernel count's profiler run first (the default) and without, one process each
        local args=("${GPU_ARGS[@]}")
        [ -z "$SMOKE" ] && args=(--device cuda --shapes llama-3.2-1b --batches 1,256 --steps 20 --warmup-steps 3)
        phase step256_counted 90 $PY bench/gpu.py "${args[@]}" --skip-hf --skip-prefill --async-scheduling both \
            --json "$OUT/gpu-step-counted.json"
        phase step256_uncounted 80 $PY bench/gpu.py "${args[@]}" --skip-hf --skip-prefill --async-scheduling both \
            --kernel-count-batches '' --json "$OUT/gpu-step-uncounted.json" ;;
    tests) phase tests 150 $PY -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests/engine tests/kv_transfer tests/bench \
        "${NEW_TESTS[@]/#/--ignore=}" "${NEW_TRANSPORT_TESTS[@]/#/--ignore=}" ;;
    *) echo "!!! unknown phase $1"; FAILED+=" $1" ;;
    esac
}

PHASES=("$@")
# The next session's order: the GPU tests of what changed since (quantized shards at TP 2 on cuda, issue 34;
# structured outputs under async scheduling: the deferred sampling with CUDA graphs and the fill ahead), what has
# never run on a GPU (35's host tier), then 38's figures not re-measured on 2026-11-27 (structured outputs, the
# SmolLM2 batch-1 step), then the sweep.
[ ${#PHASES[@]} -eq 0 ] && PHASES=(env tptests quicktests newtests hosttier structured gpu disagg handoff tests)
for p in "${PHASES[@]}"; do run_phase "$p"; done
echo "=== done $(date +%T); failed:${FAILED:- none}"
[ -z "$FAILED" ]
