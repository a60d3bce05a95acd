"""Fused float32 elementwise ops for CPUs, bit-identical to the torch expressions they replace.

Each replaces a chain of torch ops (each one a pass over memory and an allocation) by one pass, doing the same
float32 operations in the same order, each rounded as torch rounds it: the build has no -ffast-math and no FMA
contraction (-ffp-contract=off), so `a * b - c * d` is three roundings here as it is in torch.

    rope_(x, cos, sin)            x <- x * cos + rotate_half(x) * sin      (HF "rotate_half" RoPE), in place
    rms_norm_scale(x, ms, w, eps) w * (x * rsqrt(ms + eps))                (ms = x.pow(2).mean(-1), from torch)
    silu_and_mul(gate_up)         silu(gate) * up                          (Vectorized<float>, as torch's silu)

rotate_half(x) = cat(-x2, x1): its first half is x1 * c + (-x2) * s, which rounds exactly as x1 * c - x2 * s.
The mean of squares stays in torch (its summation order is torch's own). The tests hold each op to its torch
expression with `torch.equal`. `load_elementwise()` returns None when the build is impossible; callers then
run the torch expressions.
"""

from __future__ import annotations

from functools import cache

from kv_transfer import native_build
from kv_transfer.native_build import NativeModule

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>

using Vec = at::vec::Vectorized<float>;

// x: [T, H, D] float32, any row strides, the last dim contiguous; cos, sin: [T, D] float32 contiguous.
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x: [T, H, D] float32");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "cos/sin: [T, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "cos/sin: contiguous float32");
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  const int64_t st = x.stride(0), sh = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* a = xp + t * st + h * sh;
        float* b = a + half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
    }
  });
}

// x: [T, N] float32 contiguous; ms: [T] float32 (mean of squares per row); w: [N] float32.
at::Tensor rms_norm_scale(at::Tensor x, at::Tensor ms, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: [T, N] float32");
  TORCH_CHECK(ms.numel() == x.size(0) && ms.is_contiguous() && ms.scalar_type() == at::kFloat, "ms: [T]");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == at::kFloat,
              "w: [N] float32");
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* mp = ms.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float scale = 1.f / std::sqrt(mp[r] + e);  // torch.rsqrt: a correctly rounded sqrt, then a division
      const float* xr = xp + r * n;
      float* orow = op + r * n;
      for (int64_t i = 0; i < n; ++i) orow[i] = wp[i] * (xr[i] * scale);
    }
  });
  return out;
}

// gate_up: [T, 2N] float32, rows contiguous (a row stride of its own is fine): silu(gate) * up, [T, N] contiguous.
// torch's silu is x / (1 + exp(-x)) on Vectorized<float> (Sleef's exp, built for the CPU capability torch runs
// with), then a separate multiply; the same Vectorized ops here, so the same bits, where N is a multiple of the
// vector width (torch's vector loop takes two vectors a step; what is left over, it and this op do in scalar code,
// with std::exp).
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.stride(1) == 1 &&
              gate_up.size(1) % 2 == 0, "gate_up: [T, 2N] float32");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Vec one(1.f);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * stride;
      const float* u = g + n;
      float* o = op + r * n;
      int64_t i = 0;
      for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {  // torch's loop: two vectors a step
        for (int64_t j = i; j < i + 2 * Vec::size(); j += Vec::size()) {
          const Vec x = Vec::loadu(g + j);
          const Vec s = x / (one + x.neg().exp());
          (s * Vec::loadu(u + j)).store(o + j);
        }
      }
      for (; i < n; ++i) {
        const float s = g[i] / (1.f + std::exp(-g[i]));
        o[i] = s * u[i];
      }
    }
  });
  return out;
}
"""


NATIVE = NativeModule(
    name="cpu_elementwise",
    source=_SOURCE,
    functions=("rope_", "rms_norm_scale", "silu_and_mul"),
    # No -ffast-math: every operation must round exactly as torch's does. Vectorized<float> is built for the
    # ATen capability of the variant, which native_build chooses no higher than torch's own, so its exp is torch's.
    cflags=("-ffp-contract=off", "-fno-fast-math"),
)


@cache
def load_elementwise():  # noqa: ANN201 - the compiled extension module, or None
    """The compiled ops, or None (see kv_transfer/native_build.py)."""
    return native_build.load(NATIVE)
