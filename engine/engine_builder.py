"""How an engine is put together from its config, once, at start-up:

    device and dtype made concrete (`--device cuda` without a GPU fails here, before any weight loads)
    → the checkpoint (and a draft model's) → the KV cache's size: given, or what a profile forward leaves on cuda
    → the C++ kernels and the attention backend → the model on the device → its LoRA adapters, if any
    → the runner, its KV cache allocated
    → the decode step's CUDA graphs → the block-hash namespace → the speculator (a NullSpeculator when off)
    → the KV offload tier, if any (its directory's entries of this namespace found again)

`build_engine_parts` returns what an engine's step runs on, `EngineParts`; `LLMEngine` builds its control plane
(block pool, scheduler, input and output processors) around them, sized by `num_kv_blocks`. At
tensor_parallel_size N the model is rank 0's shard, its N - 1 child ranks started beside it (engine/distributed/);
the control plane stays one per engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend, get_attention_backend
from engine.config import CPU_KV_CACHE_MEMORY_BYTES, EngineConfig, SpeculativeConfig
from engine.cuda_graphs import default_capture_sizes
from engine.device import TORCH_DTYPES, resolve_engine_config
from engine.distributed.sharding import local_model_config, tp_shape
from engine.distributed.tp_sizes import TPShape
from engine.kernels.registry import load_all
from engine.kv_cache_dtype import kv_block_bytes, kv_namespace_dtype
from engine.kv_tier_blocks import TierBlocks, check_tier_config, make_tier
from engine.loader.checkpoint import Checkpoint, load_checkpoint, load_engine_checkpoint
from engine.loader.model_identity import model_identity
from engine.lora.registry import LoRARegistry
from engine.memory_profile import GIB, MemoryBaseline, MemoryProfile, num_kv_blocks_for, profile_forward
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.quantization import check_quantization, holds_quantized, quantize_fp8, quantize_int8, weights_on
from engine.model_runner import ModelRunner
from engine.spec_decode.draft_model_proposer import draft_kv_block_bytes
from engine.spec_decode.speculator import NullSpeculator, Speculator, make_proposer
from engine.tokenizer.tokenizer import Tokenizer
from kv_transfer.block_hash import BlockHashNamespace
from kv_transfer.layout import KVLayout
from kv_transfer.native_build import KernelStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    config: EngineConfig  # device and dtype concrete (engine/device.py)
    device: torch.device
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    num_kv_blocks: int
    runner: ModelRunner  # the model, its KV cache of num_kv_blocks blocks, the sampler, the CUDA graphs
    speculator: Speculator | NullSpeculator
    hash_namespace: BlockHashNamespace
    # What start-up found: the cuda memory profile (None: not profiled), the C++ kernels loaded (cpu), the
    # attention backend, the seconds CUDA-graph capture took (None: no graphs).
    memory_profile: MemoryProfile | None
    cpu_kernels: list[KernelStatus]
    attention_backend_name: str
    cuda_graph_capture_seconds: float | None
    # The tier below the KV cache (--kv-offload-dir, --kv-offload-memory; engine/kv_tier_blocks.py), its entries
    # found again; None: no tier.
    kv_tier: TierBlocks | None = None
    loras: LoRARegistry | None = None  # --enable-lora: the adapters, those of --lora-modules loaded
    # Stops what the engine started beside itself: its tensor-parallel ranks (nothing at TP 1). Idempotent.
    shutdown: Callable[[], None] = field(default=lambda: None)


def build_engine_parts(config: EngineConfig, checkpoint: Checkpoint | None = None) -> EngineParts:
    """Assemble an engine's parts from `config`, over `checkpoint` if given (else loaded as the config says).
    Raises ValueError for a config the model or the device cannot run (context length, KV cache size,
    speculative method)."""
    config = resolve_engine_config(config)
    device = torch.device(config.device)
    check_quantization(config.quantization, device)  # e.g. fp8 on cpu or an old GPU: before any load
    if isinstance(config.speculative_config, SpeculativeConfig):  # a draft model's, likewise
        check_quantization(config.speculative_config.quantization, device)
    check_tier_config(config, device)  # --kv-offload-memory on cpu, a tier at TP > 1: before any load
    _check_tensor_parallel(config, device)  # likewise
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    dtype = TORCH_DTYPES[config.dtype]
    # On cuda with no KV size given, the KV cache gets what --gpu-memory-utilization leaves after a profile
    # forward (engine/memory_profile.py), measured from here: before any weight of this engine is on the GPU.
    memory_baseline = None
    if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        memory_baseline = MemoryBaseline(device, utilization=config.gpu_memory_utilization)
    owned = checkpoint is None  # loaded here: nobody else holds its weights
    checkpoint = _quantized(checkpoint or load_engine_checkpoint(config, device), config.quantization)
    mc = checkpoint.config
    # The sizes the model takes: one clear error naming its heads before any rank starts (TensorParallelSizeError).
    shape = tp_shape(mc, config.tensor_parallel_size)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {mc.max_position_embeddings}")
    spec = config.speculative_config
    assert spec is None or isinstance(spec, SpeculativeConfig)  # EngineConfig turns a dict into one
    draft_checkpoint = _draft_checkpoint(spec, device, dtype)
    # One rank's blocks: at TP N each holds its KV heads of every block, and the KV size flags are per rank.
    block_bytes = kv_block_bytes(local_model_config(mc, shape), config.block_size, dtype, config.kv_cache_dtype)
    if draft_checkpoint is not None:  # the draft model's KV blocks come out of the same memory
        block_bytes += draft_kv_block_bytes(draft_checkpoint, config.block_size, dtype.itemsize)
    # Checked before any kernel or weight loads; 0 on cuda without a size given: set once the model is profiled.
    num_kv_blocks = _given_num_kv_blocks(config, block_bytes, max_model_len) if memory_baseline is None else 0

    # The C++ kernels load here (and build here only on a machine nobody built them for), never inside the
    # first request's forward pass.
    cpu_kernels = load_all() if device.type == "cpu" else []
    attention = get_attention_backend(config.attention_backend, scale=mc.head_dim**-0.5, device=device,
                                      kv_cache_dtype=config.kv_cache_dtype)
    logger.info("engine on %s, %s, KV cache %s, attention backend %s", device, config.dtype,
                config.kv_cache_dtype, attention.name)
    if shape.tp_size > 1:
        model = _tensor_parallel_model(checkpoint, shape, attention, config, device=device, dtype=dtype,
                                       max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, owned=owned)
        shutdown: Callable[[], None] = model.close
    else:
        model = _model_on_device(checkpoint, attention, device=device, dtype=dtype, max_model_len=max_model_len)
        shutdown = _nothing_to_stop
    # The --lora-modules adapters, on the device before the memory profile: the KV cache is sized around them.
    loras = None
    if config.enable_lora:  # a LoRAError (ValueError) naming the adapter that cannot load
        loras = LoRARegistry(mc, device=device, dtype=dtype, max_lora_rank=config.max_lora_rank,
                             max_cpu_loras=config.max_cpu_loras,
                             shard=getattr(model, "lora_shards", None))
        try:
            for name, path in config.lora_modules:
                loras.load(name, path)
        except BaseException:
            shutdown()  # the tensor-parallel ranks started for it
            raise
    memory_profile = None
    if memory_baseline is not None:
        checkpoint = dataclasses.replace(checkpoint, weights={})  # only what the model holds stays on the device
        memory_profile = _profile(model, memory_baseline, config, max_model_len)
        num_kv_blocks = num_kv_blocks_for(memory_profile, utilization=config.gpu_memory_utilization,
                                          block_bytes=block_bytes, block_size=config.block_size,
                                          max_model_len=max_model_len)
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_kv_blocks, config.block_size,
                num_kv_blocks * block_bytes / GIB)
    runner = ModelRunner(model, num_blocks=num_kv_blocks, block_size=config.block_size, seed=config.seed,
                         kv_cache_dtype=config.kv_cache_dtype)
    runner.uses_lora = loras is not None
    cuda_graph_capture_seconds = _capture_cuda_graphs(runner, config, attention, device, max_model_len)
    # Quantized weights compute other logits, hence other KV: a quantization's blocks are never another's.
    model_name = config.model_id or checkpoint.model_id or model_identity(checkpoint.path)
    hash_namespace = BlockHashNamespace(
        model=model_name if config.quantization == "none" else f"{model_name}+{config.quantization}",
        block_size=config.block_size, kv_dtype=kv_namespace_dtype(config.dtype, config.kv_cache_dtype))
    speculator = _speculator(spec, runner, draft_checkpoint, config, max_model_len)
    kv_tier = make_tier(config, device, runner.kv_cache, runner.kv_scales, hash_namespace,
                        layout=kv_layout(mc, config), ranks=rank_caches_of(runner))
    return EngineParts(
        config=config, device=device, model_config=mc, tokenizer=checkpoint.tokenizer, max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks, runner=runner, speculator=speculator, hash_namespace=hash_namespace,
        memory_profile=memory_profile, cpu_kernels=cpu_kernels, attention_backend_name=attention.name,
        cuda_graph_capture_seconds=cuda_graph_capture_seconds, kv_tier=kv_tier, shutdown=shutdown, loras=loras,
    )


def _nothing_to_stop() -> None:
    pass


def _quantized(checkpoint: Checkpoint, quantization: str) -> Checkpoint:
    """The checkpoint as `quantization` runs it (engine/model/quantization.py): int8 and fp8 quantize the float
    linear weights (a new dict: the given one may be shared by other engines); gguf needs them loaded as blocks."""
    if quantization in ("int8", "fp8"):
        quantize = quantize_int8 if quantization == "int8" else quantize_fp8
        return dataclasses.replace(checkpoint, weights=quantize(checkpoint.weights))
    if quantization == "gguf" and not holds_quantized(checkpoint.weights):
        raise ValueError(f"--quantization gguf: the checkpoint {checkpoint.path} holds no GGUF blocks (load it with "
                         "load_checkpoint(..., quantization='gguf'))")
    if quantization == "none" and holds_quantized(checkpoint.weights):
        raise ValueError("--quantization none over a checkpoint loaded with quantized weights")
    return checkpoint


def _check_tensor_parallel(config: EngineConfig, device: torch.device) -> None:
    """ValueError for what does not run at tensor_parallel_size > 1 yet."""
    if config.tensor_parallel_size == 1:
        return
    if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        raise ValueError("tensor_parallel_size > 1 on cuda needs --num-kv-blocks or --kv-cache-memory for now "
                         "(the memory profile runs on one rank)")
    from engine.distributed.group import rank_devices

    rank_devices(device, config.tensor_parallel_size)  # a GPU per rank under NCCL: refused before anything loads


def _tensor_parallel_model(checkpoint: Checkpoint, shape: TPShape, attention: AttentionBackend,
                           config: EngineConfig, *, device: torch.device, dtype: torch.dtype, max_model_len: int,
                           num_kv_blocks: int, owned: bool) -> LlamaModel:
    """Rank 0's model of a TP-N engine, its N - 1 child ranks started (engine/distributed/). Each rank's torch
    threads: --num-threads, else torch's default divided among the ranks. The checkpoint's weights are cut as they
    go when `owned` (the whole model held once at most), else left to their owner."""
    from engine.distributed.tp_model import launch_tensor_parallel

    num_threads = config.num_threads or max(1, torch.get_num_threads() // shape.tp_size)
    torch.set_num_threads(num_threads)
    logger.info("tensor parallel: %d ranks, %d threads each", shape.tp_size, num_threads)
    model = launch_tensor_parallel(
        config=checkpoint.config, weights=checkpoint.weights, shape=shape, attention=attention, device=device,
        dtype=dtype, dtype_name=config.dtype, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
        block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype, num_threads=num_threads,
        consume_weights=owned)
    return model  # type: ignore[return-value]  # the LlamaModel interface the runner uses


def _draft_checkpoint(spec: SpeculativeConfig | None, device: torch.device, dtype: torch.dtype) -> Checkpoint | None:
    """The draft model of a draft_model speculator, loaded and quantized as its "quantization" says; None for any
    other. Model drafters run on cpu only."""
    if spec is not None and spec.method in ("draft_model", "layer_skip") and device.type != "cpu":
        raise ValueError(f"speculative method {spec.method!r} runs on cpu only so far (its drafter builds its "
                         "step on the host); ngram runs on any device")
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None
    if spec.quantization == "gguf":  # the loader keeps the file's blocks (engine/model/quantization.py)
        return _quantized(load_checkpoint(spec.model, dtype=dtype, quantization="gguf"), "gguf")
    return _quantized(load_checkpoint(spec.model, dtype=dtype), spec.quantization)


def _given_num_kv_blocks(config: EngineConfig, block_bytes: int, max_model_len: int) -> int:
    """The KV blocks the config asks for, in blocks or in bytes (cpu's default without either); a ValueError if
    they cannot hold one request of max_model_len tokens."""
    kv_cache_memory = config.kv_cache_memory_bytes or CPU_KV_CACHE_MEMORY_BYTES
    num_kv_blocks = config.num_kv_blocks or kv_cache_memory // block_bytes
    if num_kv_blocks * config.block_size < max_model_len:
        raise ValueError(
            f"the KV cache ({num_kv_blocks} blocks of {config.block_size} tokens) cannot hold one request "
            f"of max_model_len={max_model_len} tokens: raise --num-kv-blocks or lower --max-model-len"
        )
    return num_kv_blocks


def _model_on_device(checkpoint: Checkpoint, attention: AttentionBackend, *, device: torch.device,
                     dtype: torch.dtype, max_model_len: int) -> LlamaModel:
    """The model over the checkpoint's weights, on `device` in `dtype`. The unfused q/k/v and gate/up tensors it
    concatenates are dropped on return: only what the model holds stays (what a memory profile counts)."""
    weights = checkpoint.weights
    floats = {name: t for name, t in weights.items() if isinstance(t, torch.Tensor)}  # quantized ones stay as they are
    if device.type != "cpu" or any(t.dtype != dtype for t in floats.values()):
        # A copy per engine (the checkpoint's CPU tensors may be shared by other engines), in the engine's
        # dtype: a checkpoint passed in may have been loaded in another (e.g. float32 with dtype "auto" on cuda).
        weights = {**weights, **{name: t.to(device=device, dtype=dtype) for name, t in floats.items()}}
    if device.type != "cpu" and holds_quantized(weights):  # quantized ones whole, in their own dtypes
        weights = weights_on(weights, device)
    return LlamaModel(checkpoint.config, weights, attention, max_positions=max_model_len)


def _profile(model: LlamaModel, baseline: MemoryBaseline, config: EngineConfig, max_model_len: int) -> MemoryProfile:
    """What the GPU holds once the weights are on it and a profile forward of the largest step has run."""
    baseline.weights_loaded()
    spec = config.speculative_config
    num_spec = spec.num_speculative_tokens if isinstance(spec, SpeculativeConfig) else 0
    profile_forward(model, num_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                    num_logit_rows=config.max_num_seqs * (1 + num_spec), block_size=config.block_size,
                    kv_cache_dtype=config.kv_cache_dtype)
    profile = baseline.measure()
    logger.info("GPU memory: %.2f GiB total × utilization %s; weights %.2f GiB, profile peak %.2f GiB, "
                "outside torch %.2f GiB", profile.total_bytes / GIB, config.gpu_memory_utilization,
                profile.weights_bytes / GIB, profile.peak_torch_bytes / GIB, profile.non_torch_bytes / GIB)
    return profile


def _capture_cuda_graphs(runner: ModelRunner, config: EngineConfig, attention: AttentionBackend,
                         device: torch.device, max_model_len: int) -> float | None:
    """Capture the decode step's CUDA graphs where they can run; the seconds capture took, or None: no graphs
    (cpu, --enforce-eager, a backend whose kernels a graph cannot hold, or tensor parallelism over gloo)."""
    if device.type != "cuda" or config.enforce_eager:
        return None
    from engine.distributed.group import cuda_backend

    if config.tensor_parallel_size > 1 and cuda_backend() != "nccl":
        logger.info("CUDA graphs off: the tensor-parallel ranks' %s collectives pass through the host, which no "
                    "graph can hold", cuda_backend())
        return None
    if attention.name != "triton" or config.kv_cache_dtype != "auto":
        logger.info("CUDA graphs off: the %s attention backend with a %s KV cache runs eagerly",
                    attention.name, config.kv_cache_dtype)
        return None
    return runner.capture_cuda_graphs(max_seq_len=min(max_model_len, config.max_seq_len_to_capture),
                                      sizes=list(config.cuda_graph_sizes or default_capture_sizes(config.max_num_seqs)))


def _speculator(spec: SpeculativeConfig | None, runner: ModelRunner, draft_checkpoint: Checkpoint | None,
                config: EngineConfig, max_model_len: int) -> Speculator | NullSpeculator:
    """The configured speculator over the runner (its proposer may draft with the runner's model and KV), or a
    NullSpeculator without speculative decoding."""
    if spec is None:
        return NullSpeculator()
    proposer = make_proposer(spec, runner, draft_checkpoint=draft_checkpoint, max_model_len=max_model_len,
                             attention_backend=config.attention_backend)
    return Speculator(spec, proposer, token_budget=config.max_num_batched_tokens)


def rank_caches_of(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """Every rank's (kv_cache, kv_scales), rank 0 first; None where a child's cache is not mapped here."""
    rank_kv_caches = getattr(runner.model, "rank_kv_caches", None)  # a TensorParallelModel (engine/distributed/)
    others = rank_kv_caches() if rank_kv_caches is not None else []
    return None if others is None else [(runner.kv_cache, runner.kv_scales), *others]


def kv_layout(model_config: ModelConfig, config: EngineConfig) -> KVLayout:
    """The layout of an engine's KV blocks (`config` with its dtype concrete): the one place it is read off the
    model and the engine config."""
    return KVLayout(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=config.block_size,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        tensor_parallel_size=config.tensor_parallel_size,
    )
