"""Engine flags, named as in vLLM, shared by every entry point that builds an engine."""

from __future__ import annotations

import argparse
import re

from engine.config import (DEVICES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, EngineConfig,
                           SpeculativeConfig)
from engine.request.lora import LoRAModule
from engine.request.sampling_params import SCHEDULING_POLICIES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def parse_size_bytes(text: str) -> int:
    """'2GiB', '512M', '1073741824' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 2GiB or 512MiB)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "BKMGT".index((unit or "B").upper()))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="model name (smollm2-135m), a .gguf file or an HF directory")
    g.add_argument("--device", default=d.device, metavar="{" + ",".join(DEVICES) + "}",
                   help="where the engine runs (cuda:N too); auto: cuda when a GPU is visible, else cpu")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="auto: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS,
                   help="dummy: seeded random weights of the named shape (smollm2-135m, llama-3.2-1b, qwen2.5-1.5b)")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; int8: per-block-per-head scales; fp8: cuda only")
    g.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="weights kept quantized: int8 (every linear layer, per output channel, quantized at load), "
                        "gguf (a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored): cpu and cuda; fp8 (e4m3 weights and "
                        "per-token activations, torch._scaled_mm): cuda, compute capability 8.9+")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help="fcfs: requests start in arrival order; priority: by each request's `priority` (lower first), "
                        "then arrival, a running request of lower priority preempted for a waiting one of higher")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="the most top logprobs (and prompt logprobs) a request may ask for per token; -1: the "
                        "vocabulary's size")
    g.add_argument("--enable-chunked-prefill", action="store_true", default=True,
                   help="vLLM's flag: a prompt longer than the step's token budget runs in chunks, always so here")
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks; overrides --kv-cache-memory")
    g.add_argument(
        "--kv-cache-memory", type=parse_size_bytes, default=None,
        help="KV cache size, e.g. 2GiB (default: 2GiB on cpu; on cuda what --gpu-memory-utilization leaves)"
    )
    g.add_argument("--kv-offload-dir", default=None, metavar="PATH",
                   help="a disk tier below the KV cache: full blocks the prefix cache evicts are written here and "
                        "loaded back instead of recomputed; a restarted worker finds them again (needs "
                        "--kv-offload-size)")
    g.add_argument("--kv-offload-size", type=parse_size_bytes, default=None,
                   help="the disk tier's size bound, e.g. 20GiB (least recently used blocks go first)")
    g.add_argument("--kv-offload-memory", type=parse_size_bytes, default=None,
                   help="a host-memory tier below a GPU's KV cache, e.g. 8GiB (cuda only)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the GPU's memory this engine uses for weights, activations and KV cache "
                        f"(cuda only; default {d.gpu_memory_utilization}; each of several engines sharing a GPU "
                        "takes its own fraction: `serve` on one machine divides the default between its workers)")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=("auto", "cpu", "torch", "triton"))
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step runs eagerly (on cuda; cpu always does)")
    g.add_argument("--cuda-graph-sizes", type=_sizes, default=None, metavar="N[,N...]",
                   help="decode batch sizes to capture as CUDA graphs (default: 1,2,4 and multiples of 8 up to "
                        "--max-num-seqs, at most 512)")
    g.add_argument("--max-seq-len-to-capture", type=int, default=d.max_seq_len_to_capture,
                   help="the longest context a CUDA graph covers; a decode step with a longer one runs eagerly")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and prepare the next step, and process the last one's outputs, while the device "
                        "runs a step (default: on with cuda, off on cpu)")
    g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="rank processes the engine runs as, each holding 1/N of the weights and of the KV cache "
                        "(N must divide the model's query heads; its KV heads split or replicate)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--model-id", default=None,
                   help="identity of the weights for KV block hashes and the prefix index (default: a digest of "
                        "the checkpoint's files)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT directories) beside the base model: a request's `model` names one")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help='the adapters loaded at start-up, as NAME=PATH or vLLM\'s JSON {"name": ..., "path": ...}; '
                        "each is a model name in the API (needs --enable-lora)")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="the most LoRA adapters running at once; requests of one more wait their turn")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the highest adapter rank loaded; an adapter above it is refused")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="the most LoRA adapters kept in memory, least recently used out first (read from their "
                        "files again when asked for); default: every loaded one")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding, as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
                        '(methods: ngram, draft_model, layer_skip; "policy": "dynamic" (default) or "fixed")')


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.replace(" ", ",").split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,4,8, got {text!r}") from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def _lora_module(text: str) -> LoRAModule:
    try:
        return LoRAModule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs,
        enable_prefix_caching=args.enable_prefix_caching,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_size_bytes=args.kv_offload_size,
        kv_offload_memory_bytes=args.kv_offload_memory,
        gpu_memory_utilization=(EngineConfig.gpu_memory_utilization if args.gpu_memory_utilization is None
                                else args.gpu_memory_utilization),
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes,
        max_seq_len_to_capture=args.max_seq_len_to_capture,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend,
        num_threads=args.num_threads,
        model_id=args.model_id,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora,
        lora_modules=tuple((m.name, m.path) for m in args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )
