"""Paged decode attention for CPUs: a small C++ kernel (built ahead: kv_transfer/native_build.py), with a torch
reference.

Pure torch has to gather a request's scattered KV blocks into one tensor before it can attend, which reads and
writes every context byte before the attention reads it again. Decode attention is memory-bound, so this kernel
walks the block table instead and reads each K and V row once, in place:

    for each request s in parallel:                       each K/V cache row is read once, for all heads
        scores[g, t] = scale * q[s, h*G + g] · K[block_table[s][t // B], t % B, h]      t < seq_len[s]
        p = softmax(scores[g, :])                                                        float32
        out[s, h*G + g] = sum_t p[g, t] * V[block_table[s][t // B], t % B, h]

`paged_decode_attention_reference` is the same contract in plain torch; the tests hold the kernel to it.
The build needs a C++ compiler and ninja; `load_kernel()` returns None (and logs why) when it cannot build.
"""

from __future__ import annotations

from functools import cache

import torch

from kv_transfer import native_build
from kv_transfer.native_build import NativeModule

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// HEAD_DIM > 0 fixes the head size at compile time (so the inner loops unroll and vectorise); 0 reads it at run
// time.
template <typename T, int HEAD_DIM>
static void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                             const int64_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t runtime_head_dim, int64_t block_size,
                             int64_t table_width, float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  // One work item per sequence: each cache row (all kv heads of one token) is read whole and once.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;
  const int64_t qsize = num_heads * head_dim;
  // The work of a sequence is its length, and the runner hands them over sorted by length: equal-count slices
  // (what parallel_for makes of [0, num_seqs)) would give the last thread all the long ones. Cut the sequences
  // into one contiguous part per thread at equal shares of the total context instead.
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_seqs));
  std::vector<int64_t> bounds(num_parts + 1, num_seqs);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += seq_lens[s];
  for (int64_t s = 0, done = 0, part = 1; s < num_seqs && part < num_parts; ++s) {
    done += seq_lens[s];
    while (part < num_parts && done * num_parts >= total * part) bounds[part++] = s + 1;
  }
  at::parallel_for(0, num_parts, 1, [&](int64_t first_part, int64_t last_part) {
    std::vector<float> scores, acc(qsize), qf(qsize), inv_sum(num_heads);
    for (int64_t s = bounds[first_part]; s < bounds[last_part]; ++s) {
      const int64_t len = seq_lens[s];
      const int64_t* table = tables + s * table_width;
      const T* qs = q + s * qsize;
      for (int64_t i = 0; i < qsize; ++i) qf[i] = static_cast<float>(qs[i]) * scale;
      scores.resize(num_heads * len);
      for (int64_t t = 0; t < len; ++t) {
        const T* kr = k_cache + (table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const T* kh = kr + (hq / group) * head_dim;
          const float* qh = qf.data() + hq * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * static_cast<float>(kh[d]);
          scores[hq * len + t] = dot;
        }
      }
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        float* sh = scores.data() + hq * len;
        const float m = *std::max_element(sh, sh + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        inv_sum[hq] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vr = v_cache + (table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const T* vh = vr + (hq / group) * head_dim;
          const float p = scores[hq * len + t];
          float* ah = acc.data() + hq * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * static_cast<float>(vh[d]);
        }
      }
      T* os = out + s * qsize;
      for (int64_t hq = 0; hq < num_heads; ++hq)
        for (int64_t d = 0; d < head_dim; ++d)
          os[hq * head_dim + d] = static_cast<T>(acc[hq * head_dim + d] * inv_sum[hq]);
    }
  });
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "head layout mismatch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_seqs, num_heads,
             num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale));
    };
    if (head_dim == 64) run(decode_attention<scalar_t, 64>);
    else if (head_dim == 128) run(decode_attention<scalar_t, 128>);
    else run(decode_attention<scalar_t, 0>);
  });
  return out;
}
"""


NATIVE = NativeModule(
    name="cpu_paged_attention",
    source=_SOURCE,
    functions=("paged_decode_attention",),
    cflags=("-ffast-math", "-fno-finite-math-only"),
)


@cache
def load_kernel():  # noqa: ANN201 - the compiled extension module, or None
    """The compiled kernel, or None (see kv_transfer/native_build.py)."""
    return native_build.load(NATIVE)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64, each >= 1
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU paged-attention kernel could not be built; see the log")
    return kernel.paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same contract in plain torch, one sequence at a time, float32 math."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        slots = block_tables[s, torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size
        keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()  # [L, Hkv, D]
        values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("hd,hld->hl", q[s].float(), keys) * scale
        out[s] = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out
