"""What one KV block costs, and what names its contents, for each `--kv-cache-dtype`.

    auto   the model's dtype                   2 * L * B * Hkv * D * itemsize bytes per block
    int8   int8 values, one float32 scale      2 * L * B * Hkv * D + 2 * L * Hkv * 4 bytes per block
           per block, per layer, K/V and head  (about a quarter of float32's: B * D = 1024 values share 4 bytes)
    fp8    float8 e4m3, unscaled (GPU only)    2 * L * B * Hkv * D bytes per block

The block-hash namespace names the KV dtype, so blocks of different precision never match each other's hashes;
a quantized cache's name also keeps the model dtype it was computed in ("int8/float32"): the int8 blocks of a
bfloat16 and of a float32 engine hold different numbers.
"""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig

SCALE_DTYPE = torch.float32


def kv_element_size(model_dtype: torch.dtype, kv_cache_dtype: str) -> int:
    return model_dtype.itemsize if kv_cache_dtype == "auto" else 1


def kv_block_bytes(mc: ModelConfig, block_size: int, model_dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes of one block across every layer, K and V, scales included."""
    element_size = kv_element_size(model_dtype, kv_cache_dtype)
    values = 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * element_size
    scales = 2 * mc.num_layers * mc.num_kv_heads * SCALE_DTYPE.itemsize if kv_cache_dtype == "int8" else 0
    return values + scales


def kv_namespace_dtype(model_dtype: str, kv_cache_dtype: str) -> str:
    """The `kv_dtype` of the block-hash namespace: "float32" unquantized (unchanged by this flag), else
    e.g. "int8/float32"."""
    return model_dtype if kv_cache_dtype == "auto" else f"{kv_cache_dtype}/{model_dtype}"
