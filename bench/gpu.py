"""The engine on a GPU (issue 22, item 8): decode, prefill and HF `generate`, each against its floor, in one run.

    PYTHONPATH=. python3 bench/gpu.py --json gpu.json                     # the GPU run (defaults), ~2 min on an H100
    PYTHONPATH=. python3 bench/gpu.py --enforce-eager                     # the same without CUDA graphs
    PYTHONPATH=. python3 bench/gpu.py --shapes llama-3.2-1b --batches 1,256 --skip-prefill --skip-hf \
        --async-scheduling both                                           # engine step with and without async
    PYTHONPATH=. python3 bench/gpu.py --device cpu --shapes smollm2-135m --batches 1,2 --context 64 --steps 3 \
        --hf-batch 2 --hf-prompt-len 16 --hf-new-tokens 4                 # CPU smoke: 1-2 min on 2 shared vCPUs
    PYTHONPATH=. python3 bench/gpu.py --quantization fp8 --shapes llama-3.2-1b --batches 1,256 \
        --async-scheduling on --json q.json                               # fp8 decode against bf16 (issue 34)

Every figure names the device it ran on (torch.cuda.get_device_name), torch's, triton's and transformers' versions.

1. Copy bandwidth: a device-to-device `copy_` of a 1 GiB tensor (64 MiB on cpu); bytes read + written over the
   median time of 20 copies after warm-up, timed with CUDA events.
2. Dense GEMM rate: an 8192^3 matmul in the engine's dtype (1024^3 on cpu), median of 10; the prefill floor's rate.
3. Decode step time, per shape (`--shapes`, dummy weights: engine/loader/dummy_weights.py) and batch (`--batches`):
   B requests of `--context` random prompt token ids, EOS ignored, stepped until every one is decoding, then
   `--steps` engine steps timed one by one (`engine.step()` wall time, scheduling, sampling and detokenizing
   included, bounded by a device synchronisation); the median. The bandwidth floor is what the step must read,
   over the measured copy bandwidth:

       weight bytes (every tensor; the tied embedding read once, as the LM head)
     + KV bytes = sum over the B requests of the tokens in their KV (context + generated, averaged over the timed
       steps) x 2 (K and V) x layers x kv_heads x head_dim x dtype bytes

   printed as step / floor and as achieved GB/s (bytes / step time) against the copy bandwidth.
   Kernels a step (`--kernel-count-batches`, default batch 1; bench/kernel_count.py): torch.profiler's CUDA
   activity over one graph replay, the graph's step run eagerly (forward and logits; and again with rotary as a
   launch of its own, where the model fuses it into the KV store), and one whole engine step: the kernel launches,
   their summed device time and the largest groups by name. Where the profiler cannot count (cpu, no Kineto), the
   row says why and the run goes on. CUPTI is detached after the count (kernel_count.release_cupti; CUDA >= 12.6,
   TEARDOWN_CUPTI=0 keeps it): attached, it slows every step timed after it in this process.
   Then `--steps` more steps back to back, with one device synchronisation before and one after: the steady-state
   step (wall time / steps). With async scheduling (`--async-scheduling`, engine/core/overlap.py) that is the
   meaningful figure: a step launches the next one before it reads the last, so a step timed alone (synchronised
   on both sides) adds the host's and the device's time that the steady state overlaps. `--async-scheduling both`
   (the default) measures decode on an engine with it and on one without, and prints steady on / off per batch;
   the target is the steady step against the graph replay alone (issue 38: <= 1.15x at Llama-1B, batch 256).
4. Prefill: `--prefill-prompts` prompts of `--prefill-len` random ids (default 8 x the context), one output token
   each, through the engine's steps (median of 3 after a warm-up). FLOPs = 2 x non-embedding params x tokens (the LM
   head runs on one position per prompt; ignored) + attention 4 x layers x heads x head_dim x L(L+1)/2 per prompt
   (QK^T and PV, causal). Floor = FLOPs / the measured GEMM rate.
5. Against HF transformers `generate`: `--hf-batch` prompts of `--hf-prompt-len` random ids, `--hf-new-tokens`
   tokens each (min = max, greedy), HF's Llama/Qwen2 model built from the same shape's config with the same dummy
   weights, in the same dtype on the same device, eager (no torch.compile, default attention); ours: the same
   prompts and token counts through the engine (all added at once, stepped until done). Tokens/s = B x N / wall.

One engine per shape serves every phase (KV blocks sized for the largest), freed before the next shape (with
`--async-scheduling both`, a second engine, without it, measures decode again after the first is freed). The
engine gets `enforce_eager` only if EngineConfig has the field (CUDA graphs for pure-decode steps); `--enforce-eager`
turns the graphs off to compare. Prefix caching is off: every prompt is random. The dummy shapes get the byte-level
stand-in tokenizer here, even SmolLM2's, so that nothing is read from disk or the network (a GPU machine has
neither the GGUF nor a way to fetch it); token ids, not text, are what is measured.

6. `--quantization int8|gguf|fp8` (bench/gpu_quantized.py): instead of 3-5, decode at each batch with that
   method's weights against the same shape unquantized, both in this run, and their ratios (step time, tokens/s;
   issue 34's fp8 targets printed as met or not). `fp8` on cpu is refused before anything is measured.

Results go to docs/benchmarks.md (the summary table printed last), not into comments here.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.gpu_floors import (
    copy_bandwidth,
    gemm_flops,
    kv_bytes_per_token,
    median_s,
    non_embedding_params,
    prefill_flops,
    wall_s,
    weight_bytes,
)
from bench.gpu_hf import hf_model, measure_hf_generate
from bench.gpu_quantized import QUANTIZATIONS, bench_quantized, check_method, gguf_dummy_weights
from bench.gpu_report import async_vs_sync, summary
from bench.kernel_count import count_step_kernels
from engine.config import EngineConfig
from engine.device import TORCH_DTYPES, resolve_device, resolve_dtype
from engine.llm_engine import LLMEngine
from engine.loader.checkpoint import Checkpoint
from engine.request.sampling_params import SamplingParams
from engine.loader.dummy_weights import (
    DUMMY_SHAPES,
    byte_level_tokenizer,
    dummy_checkpoint_path,
    dummy_model_config,
    dummy_model_id,
    dummy_weights,
)

BLOCK_SIZE = 16
SEED = 0


# -- the engine ------------------------------------------------------------------------------------------------------
def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num, length), generator=g).tolist()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """enforce_eager goes to EngineConfig only where the field exists (CUDA graphs landed)."""
    if "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)}:
        return {"enforce_eager": args.enforce_eager}
    return {}


def build_engine(shape: str, device: torch.device, dtype_name: str, args: argparse.Namespace,
                 async_scheduling: bool | None = None, quantization: str = "none") -> LLMEngine:
    """One engine for every phase of `shape`: sequences, tokens and KV blocks sized for the largest; its weights
    quantized as `quantization` says (gguf: the dummy weights' linear layers in Q4_1 blocks, bench/gpu_quantized)."""
    config = dummy_model_config(shape)
    decode_tokens = decode_max_tokens(max(args.batches), args)
    per_seq = [  # (sequences, tokens each) of every phase
        (max(args.batches), args.context + decode_tokens),
        (args.prefill_prompts, args.prefill_len + 1),
        (args.hf_batch, args.hf_prompt_len + args.hf_new_tokens),
    ]
    num_kv_blocks = max(n * -(-tokens // BLOCK_SIZE) for n, tokens in per_seq) + 8
    max_model_len = -(-max(tokens for _, tokens in per_seq) // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    engine_config = EngineConfig(
        model=shape, device=str(device), dtype=dtype_name, load_format="dummy", block_size=BLOCK_SIZE,
        async_scheduling=async_scheduling,
        max_num_seqs=max(n for n, _ in per_seq), max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, enable_prefix_caching=False, num_kv_blocks=num_kv_blocks, seed=SEED,
        attention_backend=args.attention_backend, quantization=quantization, **engine_kwargs(args),
    )
    weights = dummy_weights(config, dtype=TORCH_DTYPES[dtype_name], device=device, seed=SEED)
    checkpoint = Checkpoint(
        config=config,
        weights=gguf_dummy_weights(weights) if quantization == "gguf" else weights,  # type: ignore[arg-type]
        tokenizer=byte_level_tokenizer(config),  # not SmolLM2's real one: no GGUF read (module docstring)
        path=dummy_checkpoint_path(shape),
        model_id=dummy_model_id(shape, SEED),
    )
    return LLMEngine(engine_config, checkpoint=checkpoint)


def decode_max_tokens(batch: int, args: argparse.Namespace) -> int:
    """Tokens a decode request may make: while the batch's later prompts prefill, the first ones already decode."""
    # Each step's budget also carries the decode tokens of the prompts already done; doubled and padded for slack.
    prefill_steps = -(-batch * args.context // max(args.max_num_batched_tokens - batch, 1)) + 2
    return 2 * prefill_steps + args.warmup_steps + 2 * args.steps + 16


MAX_IDLE_STEPS = 100  # steps in a row that run nothing: the engine is stuck (e.g. out of KV blocks), not slow


def step_checked(engine: LLMEngine) -> list:
    """One engine step; a request that errored raises."""
    outs = engine.step()
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"engine step failed: {errors[0]}")
    return outs


def add_all(engine: LLMEngine, prefix: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    return ids


def step_until(engine: LLMEngine, done: Callable[[], bool], step: Callable[[], object]) -> None:
    """`step()` until `done()`; raises if the engine runs nothing for MAX_IDLE_STEPS steps in a row."""
    idle = 0
    while not done():
        step()
        idle = 0 if engine.num_scheduled_last_step else idle + 1
        if idle > MAX_IDLE_STEPS:
            raise RuntimeError(f"the engine scheduled nothing for {MAX_IDLE_STEPS} steps in a row")


def run_to_completion(engine: LLMEngine) -> int:
    """Steps until no request is left; the number of tokens produced."""
    produced = 0

    def step() -> None:
        nonlocal produced
        produced += sum(len(o.new_token_ids) for o in step_checked(engine))

    step_until(engine, lambda: not engine.has_unfinished_requests(), step)
    return produced


def abort_all(engine: LLMEngine) -> None:
    """After a failed phase: nothing of it is left to run in the next one."""
    engine.abort_all()


def check_blocks_free(engine: LLMEngine) -> None:
    num_used = engine.stats().kv_blocks_used
    if num_used:
        raise RuntimeError(f"{num_used} KV blocks still in use after a phase")


def measure_decode(
    engine: LLMEngine, batch: int, args: argparse.Namespace, floor: Callable[[float], tuple[float, float]]
) -> dict:
    """Median ms of a pure-decode step at `batch` x `args.context`; `floor(kv_tokens)` gives the step's floor in
    seconds and the bytes it reads."""
    device = engine.device
    prompts = random_prompts(batch, args.context, engine.model_config.vocab_size, seed=batch)
    ids = add_all(engine, f"d{batch}-", prompts, decode_max_tokens(batch, args))
    generated = dict.fromkeys(ids, 0)

    def step() -> None:
        outs = step_checked(engine)
        for o in outs:
            if o.finished:
                raise RuntimeError(f"{o.request_id} finished during the decode measurement ({o.finish_reason})")
            generated[o.request_id] = len(o.token_ids)

    # Every prompt computed (each request has its first token): pure decode from here.
    step_until(engine, lambda: min(generated.values()) > 0 and not engine.stats().num_requests_waiting, step)
    for _ in range(args.warmup_steps):
        step()
    times, kv_tokens = [], []
    for _ in range(args.steps):
        before = sum(generated.values())
        # The step reads each request's whole KV: its prompt and every token generated so far (the last one's K/V is
        # written by this step, then read).
        kv_tokens.append(sum(args.context + n for n in generated.values()))
        times.append(wall_s(step, device))
        if sum(generated.values()) != before + batch:
            raise RuntimeError(f"a timed step at batch {batch} did not decode every request once")
    # Steady state: the steps back to back, bounded by one synchronisation on each side (module docstring, 3).
    before = sum(generated.values())
    steady_s = wall_s(lambda: [step() for _ in range(args.steps)], device) / args.steps
    if sum(generated.values()) != before + batch * args.steps:
        raise RuntimeError(f"the steady steps at batch {batch} did not decode every request once each")
    # The step's device time alone: its CUDA graph replayed 20 times back to back on the last step's inputs (which
    # rewrites the same K/V into the same slots), without the engine's host work around it or a launch between.
    replay_ms = None
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None and graphs.bucket(batch) is not None:
        bucket = graphs.bucket(batch)
        replay_s = median_s(lambda: [graphs._replay(bucket) for _ in range(20)], device, warmup=1, repeats=5)
        replay_ms = replay_s * 1e3 / 20
    kernels = count_step_kernels(engine, batch, step) if batch in args.kernel_count_batches else None
    engine.abort_request(ids)
    check_blocks_free(engine)
    step_s = statistics.median(times)
    mean_kv_tokens = statistics.fmean(kv_tokens)
    floor_s, read_bytes = floor(mean_kv_tokens)
    return {
        "batch": batch, "context": args.context, "async_scheduling": engine.async_scheduling,
        "step_ms": step_s * 1e3, "step_ms_min": min(times) * 1e3, "steady_step_ms": steady_s * 1e3,
        "steady_over_floor": steady_s / floor_s,
        "steady_over_replay": None if replay_ms is None else steady_s * 1e3 / replay_ms,
        "replay_ms": replay_ms, "replay_over_floor": None if replay_ms is None else replay_ms / (floor_s * 1e3),
        "floor_ms": floor_s * 1e3, "step_over_floor": step_s / floor_s, "bytes_read_per_step": read_bytes,
        "achieved_gb_s": read_bytes / step_s / 1e9, "tokens_per_s": batch / step_s, "kernels": kernels,
    }


def measure_prefill(engine: LLMEngine, args: argparse.Namespace, flops_per_s: float, num_params: int) -> dict:
    vocab, n, length = engine.model_config.vocab_size, args.prefill_prompts, args.prefill_len

    def run(index: int) -> float:
        prompts = random_prompts(n, length, vocab, seed=1000 + index)

        def prefill() -> None:
            add_all(engine, f"p{index}-", prompts, max_tokens=1)
            if run_to_completion(engine) != n:
                raise RuntimeError(f"the prefill of {n} prompts did not produce {n} tokens")

        return wall_s(prefill, engine.device)

    run(0)  # warm-up: kernels compiled and tuned for these lengths
    seconds = statistics.median(run(i) for i in range(1, 4))
    check_blocks_free(engine)
    flops = prefill_flops(engine.model_config, num_params, [length] * n)
    floor_s = flops / flops_per_s
    return {
        "prompts": n, "prompt_len": length, "tokens": n * length, "seconds": seconds,
        "tokens_per_s": n * length / seconds, "flops": flops, "floor_s": floor_s,
        "tokens_per_s_floor": n * length / floor_s, "pct_of_floor": 100 * floor_s / seconds,
    }


def measure_ours_generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of the engine producing `new_tokens` for every prompt, all submitted at once."""
    add_all(engine, "gw-", prompts, max_tokens=2)  # warm-up: these prompt lengths' kernels
    run_to_completion(engine)
    produced = 0

    def run() -> None:
        nonlocal produced
        add_all(engine, "g-", prompts, max_tokens=new_tokens)
        produced = run_to_completion(engine)

    seconds = wall_s(run, engine.device)
    check_blocks_free(engine)
    if produced != len(prompts) * new_tokens:
        raise RuntimeError(f"the engine produced {produced} tokens, expected {len(prompts) * new_tokens}")
    return produced / seconds


# -- the run ---------------------------------------------------------------------------------------------------------
def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"


def phase(result: dict, key: str, fn: Callable[[], Any], engine: LLMEngine | None = None) -> Any:
    """Run one measurement; a failure is printed and recorded under result["errors"] and the run goes on (a GPU
    run is paid for by the minute: one phase's failure must not cost the others' figures)."""
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - reported, recorded, and the exit status says so
        traceback.print_exc()
        result.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
        if engine is not None:
            abort_all(engine)
        return None
    return value


def async_modes(args: argparse.Namespace) -> list[bool]:
    """The async-scheduling settings decode is measured with, the first one's engine serving every other phase."""
    return {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]


def bench_shape(shape: str, device: torch.device, dtype_name: str, bandwidth: float, flops_per_s: float,
                args: argparse.Namespace, result: dict[str, Any], save: Callable[[], None]) -> None:
    """Fills `result` phase by phase, calling `save()` after each: a run cut short keeps what it measured."""
    dtype = TORCH_DTYPES[dtype_name]
    config = dummy_model_config(shape)
    weights = dummy_weights(config, dtype=dtype, device="meta")  # shapes only, for the arithmetic
    w_bytes, num_params = weight_bytes(weights, config), non_embedding_params(weights)
    kv_token_bytes = kv_bytes_per_token(config, dtype)
    result |= {"weight_bytes": w_bytes, "non_embedding_params": num_params, "kv_bytes_per_token": kv_token_bytes,
               "decode": []}
    t0 = time.perf_counter()
    modes = async_modes(args)
    ours = None
    prompts = random_prompts(args.hf_batch, args.hf_prompt_len, config.vocab_size, seed=7)
    for index, async_scheduling in enumerate(modes):
        suffix = "" if index == 0 else f"_async_{'on' if async_scheduling else 'off'}"
        engine = phase(result, "engine" + suffix,
                       lambda a=async_scheduling: build_engine(shape, device, dtype_name, args, a))
        if engine is None:
            return
        if index == 0:
            # None: no CUDA graphs (cpu, --enforce-eager, or a backend whose kernels a graph cannot hold).
            capture_s = getattr(engine, "cuda_graph_capture_seconds", None)
            result |= {"engine_start_s": time.perf_counter() - t0, "attention_backend": engine.attention_backend_name,
                       "num_kv_blocks": engine.num_kv_blocks, "cuda_graphs": capture_s is not None,
                       "cuda_graph_capture_s": capture_s}
            graphs = f"CUDA graphs captured in {capture_s:.1f} s" if capture_s is not None else "no CUDA graphs"
            print(f"\n== {shape}: {w_bytes / 1e6:.0f} MB of weights, {kv_token_bytes} KV bytes/token, "
                  f"attention {engine.attention_backend_name}, {graphs}, engine up in {result['engine_start_s']:.1f} s",
                  flush=True)
        # Kernels a step are counted on the first engine only: the second differs in its host work, not its kernels.
        decode_args = args if index == 0 else argparse.Namespace(**{**vars(args), "kernel_count_batches": []})
        _bench_decode(engine, shape, w_bytes, kv_token_bytes, bandwidth, decode_args, result, save)
        if index == 0:
            _bench_prefill(engine, args, flops_per_s, num_params, result, save)
            if not args.skip_hf:
                ours = phase(result, "ours_generate",
                             lambda e=engine: measure_ours_generate(e, prompts, args.hf_new_tokens), engine)
        del engine
        free(device)
    result["async_vs_sync"] = async_vs_sync(result["decode"])
    for row in result["async_vs_sync"]:
        print(f"async scheduling, batch {row['batch']:>4}: steady step {row['on_steady_step_ms']:.3f} ms on, "
              f"{row['off_steady_step_ms']:.3f} ms off: off / on = {row['off_over_on']:.3f}", flush=True)

    if not args.skip_hf:

        def hf_run() -> float:
            model = hf_model(config, dummy_weights(config, dtype=dtype, device=device, seed=SEED), device, dtype)
            try:
                return measure_hf_generate(model, prompts, args.hf_new_tokens, device)
            finally:
                del model
                free(device)

        hf = phase(result, "hf_generate", hf_run)
        if ours is not None and hf is not None:
            result["hf"] = {"batch": args.hf_batch, "prompt_len": args.hf_prompt_len,
                            "new_tokens": args.hf_new_tokens, "hf_tokens_per_s": hf, "ours_tokens_per_s": ours,
                            "ours_over_hf": ours / hf}
        print(f"generate batch {args.hf_batch} ({args.hf_prompt_len} in, {args.hf_new_tokens} out): "
              f"ours {_rate(ours)} tok/s, HF {_rate(hf)} tok/s"
              + (f", x{ours / hf:.1f}" if ours is not None and hf is not None else ""), flush=True)
    free(device)
    result["shape_s"] = time.perf_counter() - t0
    save()


def bench_shape_quantized(shape: str, device: torch.device, dtype_name: str, bandwidth: float,
                          args: argparse.Namespace, result: dict[str, Any], save: Callable[[], None]) -> None:
    """--quantization: decode with none and with the method (bench/gpu_quantized.py), on the first async mode."""
    async_scheduling = async_modes(args)[0]
    kv_token_bytes = kv_bytes_per_token(dummy_model_config(shape), TORCH_DTYPES[dtype_name])
    decode_args = argparse.Namespace(**{**vars(args), "kernel_count_batches": []})
    print(f"\n== {shape}: decode with {args.quantization} against none, async scheduling {async_scheduling}",
          flush=True)
    t0 = time.perf_counter()
    bench_quantized(
        shape,
        build=lambda method: build_engine(shape, device, dtype_name, args, async_scheduling, quantization=method),
        measure=lambda engine, batch, floor: measure_decode(engine, batch, decode_args, floor),
        kv_token_bytes=kv_token_bytes, bandwidth=bandwidth, args=args, result=result, save=save, phase=phase,
        free=lambda: free(device))
    result["shape_s"] = time.perf_counter() - t0
    save()


def _bench_decode(engine: LLMEngine, shape: str, w_bytes: int, kv_token_bytes: int, bandwidth: float,
                  args: argparse.Namespace, result: dict[str, Any], save: Callable[[], None]) -> None:
    def floor(kv_tokens: float) -> tuple[float, float]:
        read = w_bytes + kv_tokens * kv_token_bytes
        return read / bandwidth, read

    mode = "on" if engine.async_scheduling else "off"
    for batch in args.batches:
        row = phase(result, f"decode_{batch}_async_{mode}", lambda b=batch: measure_decode(engine, b, args, floor),
                    engine)
        if row is None:
            continue
        row["pct_of_copy_bandwidth"] = 100 * row["achieved_gb_s"] * 1e9 / bandwidth
        result["decode"].append(row)
        save()
        print(f"decode  batch {batch:>4} x {args.context} ctx, async {mode:>3}: {row['step_ms']:8.3f} ms/step (min "
              f"{row['step_ms_min']:.3f}), steady {row['steady_step_ms']:.3f} ms  floor {row['floor_ms']:7.3f} ms  "
              f"x{row['step_over_floor']:6.2f}  {row['achieved_gb_s']:7.1f} GB/s = "
              f"{row['pct_of_copy_bandwidth']:5.1f}% of copy"
              + ("" if row["replay_ms"] is None else
                 f"; graph replay alone {row['replay_ms']:.3f} ms (x{row['replay_over_floor']:.2f} floor; steady "
                 f"step x{row['steady_over_replay']:.2f} replay)"),
              flush=True)


def _bench_prefill(engine: LLMEngine, args: argparse.Namespace, flops_per_s: float, num_params: int,
                   result: dict[str, Any], save: Callable[[], None]) -> None:
    if args.skip_prefill:
        return
    p = phase(result, "prefill", lambda: measure_prefill(engine, args, flops_per_s, num_params), engine)
    if p is not None:
        result["prefill"] = p
        save()
        print(f"prefill {p['prompts']} x {p['prompt_len']}: {p['tokens_per_s']:,.0f} tok/s in {p['seconds']:.3f} s "
              f" (FLOP floor {p['tokens_per_s_floor']:,.0f} tok/s; {p['pct_of_floor']:.1f}% of it)", flush=True)


def _rate(value: float | None) -> str:
    return "failed" if value is None else f"{value:,.0f}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b", help=f"of {', '.join(DUMMY_SHAPES)}")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence when decode is timed")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per batch")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=None, help="default: --context")
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--hf-prompt-len", type=int, default=128)
    p.add_argument("--hf-new-tokens", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--async-scheduling", choices=("on", "off", "both"), default="both",
                   help="decode measured with async scheduling, without, or both (two engines; steady on/off printed)")
    p.add_argument("--attention-backend", default="auto", help="auto | triton | torch | cpu (EngineConfig's)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM's flag), to compare")
    p.add_argument("--copy-mib", type=int, default=None, help="default: 1024 on cuda, 64 on cpu")
    p.add_argument("--gemm-n", type=int, default=None, help="default: 8192 on cuda, 1024 on cpu")
    p.add_argument("--kernel-count-batches", default="1",
                   help="decode batches whose kernels a step are counted with torch.profiler ('' for none)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="decode with these weights against unquantized ones, both in this run (bench/gpu_quantized.py)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    args.kernel_count_batches = [int(b) for b in args.kernel_count_batches.split(",") if b]
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.prefill_len is None:
        args.prefill_len = args.context
    unknown = [s for s in args.shapes if s not in DUMMY_SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {', '.join(DUMMY_SHAPES)}")
    if min(args.batches) <= 0 or args.steps <= 0 or args.context <= 0:
        p.error("--batches, --steps and --context must be positive")
    if args.quantization == "fp8" and args.device == "cpu":
        p.error("--quantization fp8 needs cuda (e4m3 weights, torch._scaled_mm); on cpu use int8 or gguf")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.quantization != "none":  # e.g. fp8 with --device auto on a machine without a GPU: before any figure
        reason = check_method(args.quantization, device)
        if reason is not None:
            print(f"--quantization {args.quantization}: {reason}", flush=True)
            return 2
    dtype_name = resolve_dtype(args.dtype, device)
    dtype = TORCH_DTYPES[dtype_name]
    graphs_field = bool(engine_kwargs(args))
    cuda_graphs = device.type == "cuda" and graphs_field and not args.enforce_eager
    if args.enforce_eager and not graphs_field:
        print("note: EngineConfig has no enforce_eager field yet; the engine runs eagerly either way")
    started = time.perf_counter()
    report: dict[str, Any] = {"device": device_name(device), **versions(), "dtype": dtype_name,
                              "cuda_graphs": cuda_graphs, "quantization": args.quantization,
                              "args": vars(args).copy()}
    print(f"device {report['device']}; torch {report['torch']}, triton {report['triton']}, transformers "
          f"{report['transformers']}; {dtype_name}; CUDA graphs asked for: {cuda_graphs}", flush=True)

    copy_bytes = (args.copy_mib or (1024 if device.type == "cuda" else 64)) << 20
    bandwidth = copy_bandwidth(device, copy_bytes)
    gemm_dtype = dtype if device.type == "cuda" else torch.float32
    gemm_n = args.gemm_n or (8192 if device.type == "cuda" else 1024)
    flops_per_s = gemm_flops(device, gemm_dtype, gemm_n)
    free(device)
    report |= {"copy_bytes": copy_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9, "gemm_n": gemm_n,
               "gemm_dtype": str(gemm_dtype).removeprefix("torch."), "gemm_tflops": flops_per_s / 1e12}
    print(f"copy bandwidth ({copy_bytes >> 20} MiB copy_, read + written): {bandwidth / 1e9:,.0f} GB/s; "
          f"{gemm_n}^3 {report['gemm_dtype']} GEMM: {flops_per_s / 1e12:,.1f} TFLOP/s", flush=True)

    report["shapes"] = {}
    write_json(report, args.json)
    for shape in args.shapes:
        report["shapes"][shape] = {}
        save = lambda: write_json(report, args.json)  # noqa: E731
        if args.quantization != "none":
            bench_shape_quantized(shape, device, dtype_name, bandwidth, args, report["shapes"][shape], save)
        else:
            bench_shape(shape, device, dtype_name, bandwidth, flops_per_s, args, report["shapes"][shape], save)
    if args.quantization == "none":
        report["cuda_graphs"] = any(r.get("cuda_graphs") for r in report["shapes"].values())
    report["total_s"] = time.perf_counter() - started
    write_json(report, args.json)
    print(f"\n{summary(report)}\n\ntotal {report['total_s']:.1f} s", flush=True)
    errors = {shape: r["errors"] for shape, r in report["shapes"].items() if "errors" in r}
    if errors:
        print(f"FAILED phases: {json.dumps(errors, indent=2)}", flush=True)
        return 1
    return 0


def write_json(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
