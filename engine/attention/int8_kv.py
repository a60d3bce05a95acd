"""The int8 KV cache: int8 values with one float32 scale per block, per K/V, per KV head (per layer).

    data    [2, num_blocks, block_size, Hkv, D] int8        value = data * scale
    scales  [2, num_blocks, Hkv]            float32         scale = absmax of the block's tokens (that head) / 127

A block fills token by token, so its scale is known only once it is full. A write therefore keeps each touched
block's scale the absmax so far: when new tokens raise it, the block's earlier tokens are requantized to the new
scale (dequantize, divide by the new scale, round; a no-op when the scale stays), and a block written at its
offset 0 starts afresh (its old scale and contents are a previous owner's). The error of a stored value is then at
most one quantization step of its block's final scale (half a step from each of at most two roundings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

QMAX = 127.0
_MIN_SCALE = 1e-8  # an all-zero block still divides safely


@dataclass(frozen=True)
class Int8KVCache:
    """One layer's int8 cache: views into the runner's all-layer tensors."""

    data: torch.Tensor  # [2, num_blocks, block_size, Hkv, D] int8
    scales: torch.Tensor  # [2, num_blocks, Hkv] float32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def quantize_store(data: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write x [T, Hkv, D] at `slot_mapping` [T] into one of K or V: data [num_blocks, B, Hkv, D] int8, scales
    [num_blocks, Hkv], updated in place (see the module docstring)."""
    block_size, num_kv_heads, head_dim = data.shape[1:]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")  # [T]
    touched, inverse = torch.unique(blocks, return_inverse=True)  # [U], [T]
    fresh = torch.zeros(touched.shape[0], dtype=torch.bool, device=x.device)
    fresh[inverse[slot_mapping % block_size == 0]] = True  # [U]: written from offset 0: a new owner
    token_amax = x.abs().amax(-1).float()  # [T, Hkv]
    new_amax = torch.zeros(touched.shape[0], num_kv_heads, device=x.device).scatter_reduce_(
        0, inverse[:, None].expand(-1, num_kv_heads), token_amax, "amax")  # [U, Hkv]
    old_scale = torch.where(fresh[:, None], 0.0, scales[touched])  # [U, Hkv]
    scale = torch.maximum(old_scale, new_amax / QMAX).clamp_min(_MIN_SCALE)  # [U, Hkv]
    # Earlier tokens of the touched blocks, to the new scale (ratio 1 leaves them bit-identical; 0 clears a fresh
    # block's stale bytes).
    ratio = (old_scale / scale)[:, None, :, None]  # [U, 1, Hkv, 1]
    data[touched] = (data[touched].float() * ratio).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    scales[touched] = scale
    quantized = (x.float() / scale[inverse][:, :, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    data.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, quantized)


def dequantize_blocks(data: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """[n] block ids -> [n, B, Hkv, D] in `dtype`."""
    values = torch.index_select(data, 0, block_ids).float()  # [n, B, Hkv, D]
    return (values * torch.index_select(scales, 0, block_ids)[:, None, :, None]).to(dtype)


def dequantize_slots(data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n] token slots -> [n, Hkv, D] in `dtype`."""
    block_size, num_kv_heads, head_dim = data.shape[1:]
    values = torch.index_select(data.view(-1, num_kv_heads, head_dim), 0, slots).float()
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    return (values * torch.index_select(scales, 0, block_ids)[:, :, None]).to(dtype)


class Int8TorchAttentionBackend(TorchAttentionBackend):
    """The torch backend over an `Int8KVCache`: quantizes on store, dequantizes what it gathers. The C++ CPU and
    the Triton kernels read float caches only, so an int8 cache always runs here."""

    name = "torch-int8"

    def store(self, kv_cache: Int8KVCache, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
              slot_mapping: torch.Tensor) -> None:
        quantize_store(kv_cache.data[0], kv_cache.scales[0], k, slot_mapping)
        quantize_store(kv_cache.data[1], kv_cache.scales[1], v, slot_mapping)

    def gather_blocks(self, kv_cache: Int8KVCache, which: int, block_ids: torch.Tensor,  # type: ignore[override]
                      dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(kv_cache.data[which], kv_cache.scales[which], block_ids, dtype)

    def gather_slots(self, kv_cache: Int8KVCache, which: int, slots: torch.Tensor,  # type: ignore[override]
                     dtype: torch.dtype) -> torch.Tensor:
        return dequantize_slots(kv_cache.data[which], kv_cache.scales[which], slots, dtype)

    def forward(  # type: ignore[override]
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Int8KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        return super().forward(q, k, v, kv_cache, meta)  # type: ignore[arg-type]
