"""Prefill / extend attention over the paged KV cache: variable query lengths, a cached prefix, causal.

Request s has query_len L_s = cu_seqlens_q[s+1] - cu_seqlens_q[s] new tokens (rows cu_seqlens_q[s] ... of the
flattened q) and context_len C_s >= L_s tokens in all, its new ones included, already stored in the cache
(`store_kv` first). Query token i sits at position C_s - L_s + i and sees the positions <= its own:

    positions   0 ........................ C-L-1 | C-L ......... C-1
                cached prefix (context C - L)    | the new tokens (queries)
    query i     sees [0, C-L+i]                       (a fresh prefill, C == L: plain causal)

    grid (cdiv(max_query_len, BLOCK_M), num_seqs, num_heads)
        one BLOCK_M tile of one request's queries, one query head; walk its key positions
        [0, min(C, last position of the tile + 1)) through the block table, BLOCK_N at a time, online softmax
        in float32 (base 2), the causal mask on every step.

`paged_prefill_attention_reference` is the same contract in plain torch; the tests hold the kernel to it, and it
to the engine's `TorchAttentionBackend`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


# With 4 warps a thread holds the gather addresses of whole [BLOCK_N, head_dim] K and V tiles: ptxas (sm_90) gives
# 251 registers at head_dim 64 and spills at 128; with 8, 160 and none (`compile_check` builds the same).
NUM_WARPS = 8


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    cache_ptr,  # [2, num_blocks, B, Hkv, D]
    tables_ptr,  # [S, max_blocks]
    cu_q_ptr,  # [S + 1]
    context_lens_ptr,  # [S]
    out_ptr,  # [T, H, D]
    scale_log2,
    stride_qt,
    stride_qh,
    stride_c_kv,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_bt,
    stride_ot,
    stride_oh,
    group,
    head_dim,
    block_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + s).to(tl.int32)
    query_len = tl.load(cu_q_ptr + s + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= query_len:
        return
    context_len = tl.load(context_lens_ptr + s).to(tl.int32)
    prefix_len = context_len - query_len
    kv_head = head // group

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the request
    row_mask = rows < query_len
    q_pos = prefix_len + rows  # their positions
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + s.to(tl.int64) * stride_bt
    # The last key any row of this tile sees is its last row's position (rows past query_len see no more).
    end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_mask = pos < end
        block = tl.load(table_row + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        row_offsets = block * stride_c_block + (pos % block_size) * stride_c_tok + kv_head * stride_c_head
        kv_offsets = row_offsets[:, None] + dims[None, :]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(cache_ptr + stride_c_kv + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        qk = tl.where(visible, qk * scale_log2, float("-inf"))
        # Every row sees position 0 in the first step, so m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / l_i[:, None]
    out_offsets = tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the requests' new tokens, back to back
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], the new K/V already stored
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32/int64: request s's queries are rows [cu[s], cu[s+1])
    context_lens: torch.Tensor,  # [num_seqs] int32/int64: cached prefix + new tokens, >= query_len
    scale: float,
    *,
    max_query_len: int | None = None,  # >= every query_len (it sizes the grid); None reads cu_seqlens_q: a sync
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Causal attention of each request's new tokens over its cached prefix and themselves, all read from the
    paged cache (run `store_kv` for the new tokens first). A request with query_len 0 writes nothing."""
    assert q.dim() == 3 and q.stride(2) == 1, f"q: [num_tokens, num_heads, head_dim], dim contiguous; got {q.shape}"
    num_tokens, num_heads, head_dim = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache: [2, blocks, B, Hkv, D], got {kv_cache.shape}"
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and kv_cache.stride(4) == 1, f"kv_cache {kv_cache.shape} does not fit q"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    assert q.dtype == kv_cache.dtype, f"q is {q.dtype}, the cache {kv_cache.dtype}"
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {q.dtype}"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, "block_tables: [num_seqs, max_blocks], rows dense"
    num_seqs = block_tables.shape[0]
    assert block_tables.dtype in (torch.int32, torch.int64), f"block_tables: int32/int64, got {block_tables.dtype}"
    assert cu_seqlens_q.shape == (num_seqs + 1,), f"cu_seqlens_q: [{num_seqs + 1}], got {cu_seqlens_q.shape}"
    assert context_lens.shape == (num_seqs,), f"context_lens: [{num_seqs}], got {context_lens.shape}"
    assert cu_seqlens_q.dtype in (torch.int32, torch.int64) and context_lens.dtype in (torch.int32, torch.int64)
    assert q.device == kv_cache.device == block_tables.device == cu_seqlens_q.device == context_lens.device
    out = torch.empty_like(q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    fp32 = q.dtype == torch.float32
    # float32 tiles are twice the bytes: smaller ones keep them in registers / shared memory.
    block_m, block_n = (32, 32) if fp32 else (64, 64)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        kv_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads // num_kv_heads,
        head_dim,
        block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=fp32,
        num_warps=NUM_WARPS,
    )
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """The same contract in plain torch, one request at a time, float32 math."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for s, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[s], bounds[s + 1]
        query_len = end - start
        if query_len == 0:
            continue
        positions = torch.arange(context_len, device=q.device)
        slots = block_tables[s].long()[positions // block_size] * block_size + positions % block_size
        keys = flat[0][slots].float().repeat_interleave(group, dim=1)  # [C, H, D]
        values = flat[1][slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale  # [H, L, C]
        q_pos = torch.arange(query_len, device=q.device) + (context_len - query_len)
        visible = positions[None, :] <= q_pos[:, None]  # [L, C]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
