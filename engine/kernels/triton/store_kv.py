"""Store the step's K/V into the paged cache, one token per program.

    slot = slot_mapping[t]                     (block_table[pos // B] * B + pos % B; -1 = a padding token: skipped)
    kv_cache[0, slot // B, slot % B] = k[t]    # [Hkv, D]
    kv_cache[1, slot // B, slot % B] = v[t]

`store_kv_reference` is the same contract in plain torch (what `TorchAttentionBackend.forward` does, plus the
skip); the tests hold the kernel to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D], any token and head strides, dim contiguous
    v_ptr,
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int32/int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a padding token (slot -1) loads and stores nothing
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        dst = (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_tok
        dst_offsets = dst + heads[:, None] * stride_c_head + dims[None, :]
        tl.store(cache_ptr + dst_offsets, k, mask=mask)
        tl.store(cache_ptr + stride_c_kv + dst_offsets, v, mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
) -> None:
    assert k.dim() == 3 and k.shape == v.shape, f"k and v: [T, Hkv, D] of one shape, got {k.shape} and {v.shape}"
    num_tokens, num_kv_heads, head_dim = k.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache: [2, blocks, B, Hkv, D], got {kv_cache.shape}"
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), f"kv_cache {kv_cache.shape} does not fit k {k.shape}"
    assert k.dtype == v.dtype == kv_cache.dtype, f"dtypes differ: k {k.dtype}, v {v.dtype}, cache {kv_cache.dtype}"
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping: [{num_tokens}], got {slot_mapping.shape}"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping: int32/int64, got {slot_mapping.dtype}"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.shape[2],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_reference(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T], -1 = skip
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    row = k.shape[1] * k.shape[2]
    kv_cache[0].view(-1, row).index_copy_(0, slots, k[keep].reshape(-1, row))
    kv_cache[1].view(-1, row).index_copy_(0, slots, v[keep].reshape(-1, row))
