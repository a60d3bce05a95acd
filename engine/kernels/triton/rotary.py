"""Neox-style ("rotate_half") rotary embedding, in place on q and k: one program per token, all heads.

    c, s = cos_cache[positions[t]], sin_cache[positions[t]]        [D] each (`engine.model.rope.RotaryEmbedding`'s
                                                                    tables: the frequencies twice, cat(f, f))
    x1, x2 = x[:D/2], x[D/2:]                                       for every head of q[t] and of k[t]
    x <- (x1 * c[:D/2] - x2 * s[:D/2],  x2 * c[D/2:] + x1 * s[D/2:])   = x * c + rotate_half(x) * s, float32 math

`rotary_reference` is the same contract in plain torch (rope.py's expression, in float32); the tests hold the
kernel to it, and it to `RotaryEmbedding`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, stride_cos, stride_sin, pos, half, BLOCK_HALF: tl.constexpr):
    """Position `pos`'s table rows, both halves of each, in float32: (c1, c2, s1, s2), [BLOCK_HALF] each."""
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    c1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=col_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + half + cols, mask=col_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=col_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + half + cols, mask=col_mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotate_halves(x1, x2, c1, c2, s1, s2):
    """The rotation itself, float32 [BLOCK_H, BLOCK_HALF] halves in and out: one expression for every kernel that
    rotates (this one and rotary_store_kv.py), so that they round alike."""
    out1 = x1 * c1[None, :] - x2 * s1[None, :]
    out2 = x2 * c2[None, :] + x1 * s2[None, :]
    return out1, out2


@triton.jit
def _rotate(
    x_ptr, stride_t, stride_h, t, num_heads, half, c1, c2, s1, s2, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
    ptr1 = x_ptr + t * stride_t + heads[:, None] * stride_h + cols[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = _rotate_halves(x1, x2, c1, c2, s1, s2)
    tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + half, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T]
    cos_ptr,  # [max_positions, D]
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_heads,
    num_kv_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, stride_cos, stride_sin, pos, half, BLOCK_HALF)
    _rotate(q_ptr, stride_qt, stride_qh, t, num_heads, half, c1, c2, s1, s2, BLOCK_H, BLOCK_HALF)
    _rotate(k_ptr, stride_kt, stride_kh, t, num_kv_heads, half, c1, c2, s1, s2, BLOCK_KV, BLOCK_HALF)


def rotary(
    q: torch.Tensor,  # [T, H, D], rotated in place (may be a strided view of the fused qkv)
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    positions: torch.Tensor,  # [T] int32/int64
    cos_cache: torch.Tensor,  # [max_positions, D]
    sin_cache: torch.Tensor,  # [max_positions, D]
) -> None:
    assert q.dim() == 3 and k.dim() == 3, f"q: [T, H, D], k: [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}"
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k: head_dim contiguous"
    assert q.dtype == k.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16), f"dtype {q.dtype}"
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), "positions: [T] int"
    assert cos_cache.dim() == 2 and cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == head_dim, (
        f"cos/sin caches: [max_positions, {head_dim}], got {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)}"
    )
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1, "cos/sin caches: rows contiguous"
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_heads,
        k.shape[1],
        head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )


def rotary_reference(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_cache: torch.Tensor,  # [max_positions, D]
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies, float32 math, in the inputs' dtype."""
    cos = cos_cache[positions].float().unsqueeze(1)  # [T, 1, D]
    sin = sin_cache[positions].float().unsqueeze(1)
    half = q.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    return rotate(q), rotate(k)
