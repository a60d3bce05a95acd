"""Rotary on q and k, and the KV store, in one launch: one program per token, all heads.

    c, s = cos_cache[positions[t]], sin_cache[positions[t]]    as `rotary.py` (the same jit helpers, so the same
                                                                float32 expression and rounding)
    q[t] <- rotate(q[t])                                        in place, in q's dtype
    slot = slot_mapping[t]                                      -1 = a padding token: q is rotated, nothing stored
    kv_cache[0, slot // B, slot % B] = rotate(k[t])             rounded to k's dtype (the cache's: they are equal)
    kv_cache[1, slot // B, slot % B] = v[t]

This is `rotary(q, k, ...)` followed by `store_kv(k, v, kv_cache, slot_mapping)` (their kernels, one after the other)
with one difference: k itself is left unrotated, since the attention reads K from the cache only. The result is
bit-equal to the two launches: the same float32 rotation, rounded once to the one dtype of k and the cache.

Float caches only (the model's dtype, as `store_kv`): an int8 cache's per-block scales are a max over every token
of the step that lands in a block and rescale the block's earlier tokens (`engine/attention/int8_kv.py`), not a
per-token store; int8 and fp8 caches run on the torch attention backend, which stores them itself.
`rotary_store_kv_reference` is the same contract in plain torch, composed of the two references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.rotary import _cos_sin, _rotate, _rotate_halves, rotary_reference
from engine.kernels.triton.store_kv import store_kv_reference


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,  # [T, H, D], rotated in place
    k_ptr,  # [T, Hkv, D], read only
    v_ptr,  # [T, Hkv, D]
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int32/int64, -1 = skip
    positions_ptr,  # [T]
    cos_ptr,  # [max_positions, D]
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_cos,
    stride_sin,
    num_heads,
    num_kv_heads,
    half,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, stride_cos, stride_sin, pos, half, BLOCK_HALF)
    _rotate(q_ptr, stride_qt, stride_qh, t, num_heads, half, c1, c2, s1, s2, BLOCK_H, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a padding token (slot -1) stores nothing (a branch: the interpreter refuses a scalar mask term)
        heads = tl.arange(0, BLOCK_KV)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < num_kv_heads) & (cols[None, :] < half)  # [BLOCK_KV, BLOCK_HALF]
        k1_ptr = k_ptr + t * stride_kt + heads[:, None] * stride_kh + cols[None, :]
        k1 = tl.load(k1_ptr, mask=mask, other=0.0).to(tl.float32)
        k2 = tl.load(k1_ptr + half, mask=mask, other=0.0).to(tl.float32)
        out1, out2 = _rotate_halves(k1, k2, c1, c2, s1, s2)
        v1_ptr = v_ptr + t * stride_vt + heads[:, None] * stride_vh + cols[None, :]
        v1 = tl.load(v1_ptr, mask=mask)
        v2 = tl.load(v1_ptr + half, mask=mask)
        dst = (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_tok
        dst1 = cache_ptr + dst + heads[:, None] * stride_c_head + cols[None, :]
        tl.store(dst1, out1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst1 + half, out2.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst1 + stride_c_kv, v1, mask=mask)
        tl.store(dst1 + stride_c_kv + half, v2, mask=mask)


def rotary_store_kv(
    q: torch.Tensor,  # [T, H, D], rotated in place (may be a strided view of the fused qkv)
    k: torch.Tensor,  # [T, Hkv, D], not written
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
    positions: torch.Tensor,  # [T] int32/int64
    cos_cache: torch.Tensor,  # [max_positions, D]
    sin_cache: torch.Tensor,  # [max_positions, D]
) -> None:
    assert q.dim() == 3 and k.dim() == 3, f"q: [T, H, D], k: [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape == v.shape and k.shape[0] == num_tokens and k.shape[2] == head_dim, (
        f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "q, k and v: head_dim contiguous"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache: [2, blocks, B, Hkv, D], got {kv_cache.shape}"
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), f"kv_cache {kv_cache.shape} does not fit k {k.shape}"
    assert kv_cache.stride(4) == 1, "kv_cache: head_dim contiguous"
    assert q.dtype == k.dtype == v.dtype == kv_cache.dtype, (
        f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}, cache {kv_cache.dtype}")
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {q.dtype}"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64), (
        f"slot_mapping: [{num_tokens}] int32/int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), "positions: [T] int"
    assert cos_cache.dim() == 2 and cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == head_dim, (
        f"cos/sin caches: [max_positions, {head_dim}], got {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)}"
    )
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1, "cos/sin caches: rows contiguous"
    if num_tokens == 0:
        return
    _rotary_store_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        kv_cache,
        slot_mapping,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        head_dim // 2,
        kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )


def rotary_store_kv_reference(
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], not written
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T], -1 = skip
    positions: torch.Tensor,  # [T]
    cos_cache: torch.Tensor,  # [max_positions, D]
    sin_cache: torch.Tensor,
) -> None:
    rotated_q, rotated_k = rotary_reference(q, k, positions, cos_cache, sin_cache)
    q.copy_(rotated_q)
    store_kv_reference(rotated_k, v, kv_cache, slot_mapping)
