"""The engine's configuration: what `LLM(...)` and the CLI flags (vLLM's names) set, speculative decoding's
included. No I/O here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from engine.request.sampling_params import DEFAULT_MAX_LOGPROBS, SCHEDULING_POLICIES

DTYPES = ("auto", "float32", "bfloat16", "float16")  # "auto": bfloat16 on cuda, float32 on cpu (engine/device.py)
DEVICES = ("auto", "cpu", "cuda")  # "cuda:N" is taken too; "auto": cuda when torch sees a GPU
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names; "dummy": seeded random weights of a named shape
# vLLM's --quantization: which linear weights stay quantized (engine/model/quantization.py says what each does).
QUANTIZATIONS = ("none", "int8", "gguf", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # "auto": the model's dtype; int8: per-block-per-head scales; fp8: GPU only
CPU_KV_CACHE_MEMORY_BYTES = 2 << 30  # the KV cache on cpu when neither its size nor its block count is given
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = "smollm2-135m"
    # Both made concrete once, at start-up, by engine/device.py's resolve_engine_config (this module does no I/O).
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    kv_cache_dtype: str = "auto"
    # "none": float weights; "int8": every linear weight and the LM head quantized at load; "gguf": a GGUF file's
    # Q4_0/Q4_1/Q8_0 linear tensors kept as its blocks, the head in Q8_0; "fp8": e4m3, cuda (sm_89+) only.
    quantization: str = "none"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    scheduling_policy: str = "fcfs"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # vLLM's: the most (prompt) logprobs a request may ask for; -1: vocab
    enable_prefix_caching: bool = True
    # The KV cache's size, first given wins: num_kv_blocks; kv_cache_memory_bytes; else on cpu 2 GiB
    # (CPU_KV_CACHE_MEMORY_BYTES), on cuda what gpu_memory_utilization leaves (engine/memory_profile.py).
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # A tier below the KV cache for the blocks its prefix cache evicts (engine/core/kv_tier.py): a directory and its
    # size bound (given together), or cuda only, host memory of this size. None: no tier.
    kv_offload_dir: str | None = None
    kv_offload_size_bytes: int | None = None
    kv_offload_memory_bytes: int | None = None
    # vLLM's flag: the fraction of the GPU's memory this engine may use (weights, activations, KV cache); cuda only.
    gpu_memory_utilization: float = 0.9
    seed: int | None = None  # for requests without their own seed
    # "auto": on cuda "triton" (engine/kernels/triton/) when triton imports, else "torch"; on cpu "cpu" (the C++
    # paged decode kernel) when it builds, else "torch"; an int8 KV cache always takes "torch" (it dequantizes).
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # What namespaces KV block hashes (with block size and dtype): None: a digest of the checkpoint's weights
    # (engine/loader/model_identity.py), so two copies of the same weights share hashes wherever they live.
    model_id: str | None = None
    # CUDA graphs of the decode step (cuda with the triton backend and a model-dtype cache; engine/cuda_graphs.py):
    # enforce_eager turns them off (vLLM's --enforce-eager); the batch sizes captured, None: 1, 2, 4, then every
    # multiple of 8 up to max_num_seqs (at most 512).
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # The longest context a graph covers (vLLM's --max-seq-len-to-capture): its block tables are this wide, and a step
    # with a longer context runs eagerly.
    max_seq_len_to_capture: int = 8192
    # vLLM's --async-scheduling: the host schedules and prepares step N+1, and processes step N's outputs, while the
    # device runs step N; the sampled tokens stay on the device for the next step's inputs (engine/core/overlap.py
    # says which steps overlap). None: on when the device is cuda, off on cpu (made concrete by engine/device.py).
    async_scheduling: bool | None = None
    # Tensor parallelism (vLLM's --tensor-parallel-size): the engine runs as this many rank processes, each holding
    # its shard of the weights and of the KV cache (engine/distributed/). 1: one process.
    tensor_parallel_size: int = 1
    # LoRA adapters (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras;
    # engine/lora/): the adapters loaded at start-up as (name, PEFT directory) pairs; the most adapters one step runs;
    # their top rank; the most kept in memory (None: all, not vLLM's default of max_loras: see engine/lora/registry.py).
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding; a dict of vLLM's keys is taken too (`LLM(speculative_config={...})`). None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and self.device == "cpu":
            raise ValueError("kv_cache_dtype fp8 needs a CUDA device (--device cuda); on cpu use int8")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization == "fp8" and self.device == "cpu":
            raise ValueError("quantization fp8 needs cuda (--device cuda); on cpu use int8 or gguf")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary) or at least 0, got {self.max_logprobs}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len_to_capture"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if (self.kv_offload_dir is None) != (self.kv_offload_size_bytes is None):
            raise ValueError("--kv-offload-dir and --kv-offload-size go together: the directory and its size bound")
        if self.kv_offload_dir is not None and not self.kv_offload_dir.strip():
            raise ValueError("kv_offload_dir must be non-empty when given")
        for name in ("kv_offload_size_bytes", "kv_offload_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_offload_memory_bytes is not None and self.device == "cpu":
            raise ValueError("--kv-offload-memory is a host-memory tier under a GPU's KV cache; on cpu the KV cache "
                             "is already in host memory (raise --kv-cache-memory, or use --kv-offload-dir)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.model_id is not None and not self.model_id.strip():
            raise ValueError("model_id must be non-empty when given")
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
            if not self.cuda_graph_sizes or min(self.cuda_graph_sizes) <= 0:
                raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {list(self.cuda_graph_sizes)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        object.__setattr__(self, "lora_modules", tuple((str(n), str(p)) for n, p in self.lora_modules))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip")
SPECULATIVE_POLICIES = ("dynamic", "fixed")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """`--speculative-config` / `LLM(speculative_config=...)`: which proposer, how many drafts, which policy. No I/O.

    Keys as vLLM names them:

        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        {"method": "draft_model", "model": NAME_OR_PATH, "num_speculative_tokens": 4, "quantization": "int8"}
        {"method": "layer_skip", "num_layers": K, "num_speculative_tokens": 4}

    plus `"policy"`: "dynamic" (the default: k chosen per request and step, up to num_speculative_tokens) or "fixed"
    (always num_speculative_tokens, as far as the budget and the proposer allow). `"quantization"` (vLLM's key):
    the draft model's weights, as --quantization says for the target's (default none; the target's own method
    does not carry over: a draft is chosen for its speed, its weights by their own file). layer_skip drafts with
    the target's layers, quantized as the target's are.
    """

    method: str
    num_speculative_tokens: int = 4  # the most drafts per request and step
    policy: str = "dynamic"
    prompt_lookup_min: int = 2  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 5  # ngram: the longest
    model: str | None = None  # draft_model: a name or path our loaders load, with the target's vocabulary
    num_layers: int | None = None  # layer_skip: the target's first K layers draft
    quantization: str = "none"  # draft_model: its weights (QUANTIZATIONS; engine/model/quantization.py)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.policy not in SPECULATIVE_POLICIES:
            raise ValueError(
                f"speculative policy must be one of {', '.join(SPECULATIVE_POLICIES)}, got {self.policy!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('draft_model needs "model": a name or path of the draft model')
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.quantization != "none" and self.method != "draft_model":
            raise ValueError(f'"quantization" is the draft model\'s; {self.method} drafts with no weights of its own')
        if self.method == "layer_skip" and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError(f'layer_skip needs "num_layers": a positive integer, got {self.num_layers!r}')

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM-style keys; unknown keys are an error (a typo must not silently disable something)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in values:
            raise ValueError(f'speculative_config needs "method", one of {", ".join(SPECULATIVE_METHODS)}')
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
        return cls.from_dict(values)
