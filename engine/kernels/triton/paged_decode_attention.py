"""Paged decode attention: one query token per sequence, over its KV blocks, with GQA grouping and split-K.

    grid (num_seqs, num_kv_heads, num_splits)          one program per sequence x KV head x context partition
        the G = num_heads / num_kv_heads query heads of KV head h are one [G, D] tile (padded to 16 rows for
        tl.dot), so each K/V row of the partition is read once for all of them:
        for each tile of BLOCK_N positions t in [split * P, min((split + 1) * P, seq_len)):
            slot = block_table[s][t // B] * B + t % B
            online softmax over scores = scale * q[s, h*G : (h+1)*G] · K[slot, h]          (float32, base 2)
        one split:  out = acc / sum
        several:    (acc, max, sum) per split to float32 scratch; `_reduce_kernel`, grid (num_seqs, num_heads),
                    combines them: out = Σ 2^(max_j - M) acc_j / Σ 2^(max_j - M) sum_j,  M = max_j max_j

Split-K gives a long context several programs, so that a small batch of long sequences still fills the GPU;
`partition_size` P picks it (None: a heuristic from the batch shape). A sequence of length 0 (a padding row)
gets zeros. `paged_decode_attention_reference` is the same contract in plain torch; the tests hold the kernel to
it, and it to the engine's `TorchAttentionBackend`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # context positions per inner step (small launches, float32); a partition is a whole number of them
WIDE_BLOCK_N = 64  # ... for launches of many programs in 16-bit dtypes
# A launch of fewer (sequence, KV head) programs than this splits its contexts ...
SPLIT_BELOW_PROGRAMS = 512
# ... until it has about this many programs (~15 per SM on a 132-SM GPU) ...
TARGET_PROGRAMS = 2048
# ... but never into partitions shorter than this: below it the reduce costs more than the split gains ...
MIN_PARTITION_SIZE = 256
# ... except in a launch of fewer programs than this (a handful of sequences): there every position step is a link
# in one program's latency chain, and shorter partitions run side by side instead.
FEW_PROGRAMS = 64
MIN_PARTITION_SIZE_FEW = 64
# The launch shapes above come from a sweep on an H200 (bf16, head_dim 64, 1,024-token contexts; docs/benchmarks.md,
# "GPU"): at 256 x 8 programs, 64-position steps pipelined 2 deep read 3.7 TB/s against 2.9 for the first version
# (32 positions, Triton's default 3 stages, 512 target programs); at one sequence, 3 stages cost 3x a 1-stage loop.


def num_warps(head_dim: int, fp32: bool) -> int:
    """Warps per program: 8 where 4 would hold a [BLOCK_N, head_dim] tile's gather addresses in more than ~200
    registers a thread, or spill (ptxas for sm_90, `compile_check`); 4 otherwise, for more programs per SM."""
    return 8 if fp32 or head_dim > 64 else 4


@triton.jit
def _decode_kernel(
    q_ptr,  # [S, H, D]
    cache_ptr,  # [2, num_blocks, B, Hkv, D]
    tables_ptr,  # [S, max_blocks]
    seq_lens_ptr,  # [S]
    out_ptr,  # [S, H, D]; written when one split
    part_acc_ptr,  # [S, H, num_splits, D] float32; written when several
    part_max_ptr,  # [S, H, num_splits] float32
    part_sum_ptr,  # [S, H, num_splits] float32
    scale_log2,  # scale * log2(e): scores in base 2
    stride_qs,
    stride_qh,
    stride_c_kv,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_bt,
    stride_os,
    stride_oh,
    num_heads,
    group,
    head_dim,
    block_size,
    partition_size,
    num_splits,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 dots, not TF32
):
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * group + rows  # [BLOCK_H]
    head_mask = rows < group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    s64 = s.to(tl.int64)
    q = tl.load(
        q_ptr + s64 * stride_qs + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = tables_ptr + s64 * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_mask = pos < end
        block = tl.load(table_row + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        row_offsets = block * stride_c_block + (pos % block_size) * stride_c_tok + kv_head * stride_c_head
        kv_offsets = row_offsets[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + stride_c_kv + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(pos_mask[None, :], qk * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every step has at least one position < end
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # An empty partition (start >= seq_len) writes max -inf, sum 0: the reduce skips it by seq_len anyway.
        part = (s64 * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_acc_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + part, m_i, mask=head_mask)
        tl.store(part_sum_ptr + part, l_i, mask=head_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a length-0 row: acc is 0, so is out
        out_offsets = s64 * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_kernel(
    part_acc_ptr,  # [S, H, num_splits, D] float32
    part_max_ptr,  # [S, H, num_splits] float32, base 2
    part_sum_ptr,  # [S, H, num_splits] float32
    seq_lens_ptr,  # [S]
    out_ptr,  # [S, H, D]
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    partition_size,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    num_used = (seq_len + partition_size - 1) // partition_size  # the partitions that saw any context
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_used
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    base = (s.to(tl.int64) * num_heads + h) * num_splits
    m = tl.load(part_max_ptr + base + splits, mask=split_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + base + splits, mask=split_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + (base + splits[:, None]) * head_dim + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    m_all = tl.maximum(tl.max(m, 0), -1e30)  # finite even for a length-0 row (no used partition): no inf - inf
    weight = tl.where(split_mask, tl.exp2(m - m_all), 0.0)  # [BLOCK_S]
    num = tl.sum(acc * weight[:, None], 0)  # [BLOCK_D]
    den = tl.sum(l * weight, 0)
    out = num / tl.where(den > 0, den, 1.0)  # a length-0 row: num is 0, so is out
    out_offsets = s.to(tl.int64) * stride_os + h * stride_oh + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int = BLOCK_N) -> int:
    """The partition (tokens, a multiple of block_n) for split-K: a launch of fewer than SPLIT_BELOW_PROGRAMS
    programs splits a long context until it has about TARGET_PROGRAMS, in partitions of at least
    MIN_PARTITION_SIZE tokens (MIN_PARTITION_SIZE_FEW under FEW_PROGRAMS programs). >= max_seq_len: no split."""
    max_seq_len = max(max_seq_len, 1)
    programs = max(num_seqs * num_kv_heads, 1)
    want_splits = 1 if programs >= SPLIT_BELOW_PROGRAMS else triton.cdiv(TARGET_PROGRAMS, programs)
    min_partition = MIN_PARTITION_SIZE_FEW if programs < FEW_PROGRAMS else MIN_PARTITION_SIZE
    num_splits = max(1, min(want_splits, max_seq_len // min_partition))
    return triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n


def choose_block_n_and_stages(num_seqs: int, num_kv_heads: int, dtype: torch.dtype) -> tuple[int, int]:
    """Positions per inner step and the loop's pipelining depth: a few programs (a small batch) are latency-bound,
    and a 1-stage loop of 32 is fastest; many programs are bandwidth-bound, and 64 a step, 2 deep, reads most."""
    if num_seqs * num_kv_heads < FEW_PROGRAMS or dtype == torch.float32:
        return BLOCK_N, 1
    return WIDE_BLOCK_N, 2


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, each <= max_blocks * block_size
    scale: float,
    *,
    max_seq_len: int | None = None,  # >= every seq_len (it sizes the grid); None reads seq_lens: a device sync
    partition_size: int | None = None,  # tokens per split, a multiple of block_n; None: choose_partition_size
    block_n: int | None = None,  # context positions per inner step (a power of two >= 16); None: chosen, with
    stages: int | None = None,  # the inner loop's software-pipelining depth, by choose_block_n_and_stages
    warps: int | None = None,  # None: num_warps(head_dim, fp32)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], q's dtype
    """Attention of each sequence's one query over its first seq_lens[s] cached positions (its own K/V stored
    already). Positions past seq_len are never read, whatever the table holds there. With a CUDA graph, pass
    max_seq_len and partition_size so that no host sync happens and the grid stays fixed."""
    assert q.dim() == 3 and q.stride(2) == 1, f"q: [num_seqs, num_heads, head_dim], dim contiguous; got {q.shape}"
    num_seqs, num_heads, head_dim = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache: [2, blocks, B, Hkv, D], got {kv_cache.shape}"
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and kv_cache.stride(4) == 1, f"kv_cache {kv_cache.shape} does not fit q"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    assert q.dtype == kv_cache.dtype, f"q is {q.dtype}, the cache {kv_cache.dtype}"
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {q.dtype}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, f"block_tables: [{num_seqs}, max_blocks]"
    assert block_tables.dtype in (torch.int32, torch.int64), f"block_tables: int32/int64, got {block_tables.dtype}"
    assert block_tables.stride(1) == 1, "block_tables: each row contiguous (any row stride)"
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype in (torch.int32, torch.int64), "seq_lens: [num_seqs] int"
    assert q.device == kv_cache.device == block_tables.device == seq_lens.device, "all inputs on one device"
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    chosen_block_n, chosen_stages = choose_block_n_and_stages(num_seqs, num_kv_heads, q.dtype)
    block_n = block_n or chosen_block_n
    stages = stages or chosen_stages
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_seq_len, block_n)
    assert partition_size > 0 and partition_size % block_n == 0, f"partition_size: a multiple of {block_n}"
    num_splits = max(1, triton.cdiv(max_seq_len, partition_size))
    group = num_heads // num_kv_heads
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:  # unused
        part_acc = part_max = part_sum = out
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_max,
        part_sum,
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
        num_heads,
        group,
        head_dim,
        block_size,
        partition_size,
        num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=split,
        IEEE=q.dtype == torch.float32,
        num_warps=warps or num_warps(head_dim, q.dtype == torch.float32),
        num_stages=stages,
    )
    if split:
        _reduce_kernel[(num_seqs, num_heads)](
            part_acc,
            part_max,
            part_sum,
            seq_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            partition_size,
            num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], q's dtype
    """The same contract in plain batched torch, float32 math: gather every table's blocks, mask past seq_len."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if num_seqs == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len, device=q.device)  # [L]
    blocks = block_tables.long().gather(1, (positions // block_size).expand(num_seqs, -1))  # [S, L]
    slots = blocks * block_size + positions % block_size
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    keys = flat[0][slots].float()  # [S, L, Hkv, D]
    values = flat[1][slots].float()
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [S, Hkv, G, D]
    scores = torch.einsum("shgd,slhd->shgl", qg, keys) * scale
    valid = positions[None, :] < seq_lens[:, None]  # [S, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a length-0 row: zeros
    values = values.masked_fill(~valid[:, :, None, None], 0.0)  # what lies past seq_len never counts, NaN or not
    out = torch.einsum("shgl,slhd->shgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
