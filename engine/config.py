"""The engine's configuration: what `LLM(...)` and the CLI flags (vLLM's names) set. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.spec_decode.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 2 << 30
    seed: int | None = None  # for requests without their own seed
    attention_backend: str = "auto"  # "cpu" (C++ paged decode kernel) when it builds, else "torch"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # What namespaces KV block hashes (with block size and dtype): None: a digest of the checkpoint's weights
    # (engine/loader/model_identity.py), so two copies of the same weights share hashes wherever they live.
    model_id: str | None = None
    # Speculative decoding; a dict of vLLM's keys is taken too (`LLM(speculative_config={...})`). None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.model_id is not None and not self.model_id.strip():
            raise ValueError("model_id must be non-empty when given")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
