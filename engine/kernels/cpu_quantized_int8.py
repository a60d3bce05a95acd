"""The C++ of the int8 weight-only kernels (engine/kernels/cpu_quantized_linear.py says what they compute): float32
activations, each int8 weight converted to float in registers, 512-bit vectors in the AVX-512 build; the entry point
int8_linear. SOURCE follows cpu_quantized_linear's common prelude (includes, qk::hsum, qk::grain_rows).
"""

from __future__ import annotations

FUNCTIONS = ("int8_linear",)

SOURCE = r"""
namespace qk {

// Float vectors for the int8 kernels: 8 lanes (AVX2) or, in the AVX-512 build, 16 (Zen 5 runs 512-bit FMAs at
// full width: twice the multiply-adds an instruction).
struct V256 {
  using F = __m256;
  static constexpr int N = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F weights(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float sum(F v) { return hsum(v); }
};
#ifdef __AVX512F__
struct V512 {
  using F = __m512;
  static constexpr int N = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F weights(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
using VInt8 = V512;
constexpr int kInt8Rows = 4, kInt8Tokens = 6;  // 24 accumulators + 4 weight vectors in 32 registers
#else
using VInt8 = V256;
constexpr int kInt8Rows = 2, kInt8Tokens = 4;  // 8 + 2 in 16
#endif
constexpr int64_t kInt8Chunk = 64;  // rows a chunk: 64 x K int8 (36 KiB at K = 576) stay in L2

// y[t, o] = scale[o] Σ_i x[t, i] q[o, i], TT tokens of one row; NA accumulators for few tokens.
template <int TT, class V = VInt8>
inline void int8_tile(const int8_t* row, int64_t K, const float* x, float scale, float* y, int64_t O) {
  constexpr int NA = TT == 1 ? 4 : TT == 2 ? 2 : 1, N = V::N;
  typename V::F acc[NA][TT];
  for (int a = 0; a < NA; ++a)
    for (int t = 0; t < TT; ++t) acc[a][t] = V::zero();
  int64_t k = 0;
  for (; k + N * NA <= K; k += N * NA) {
    for (int a = 0; a < NA; ++a) {
      const typename V::F w = V::weights(row + k + N * a);
      for (int t = 0; t < TT; ++t) acc[a][t] = V::fma(w, V::load(x + t * K + k + N * a), acc[a][t]);
    }
  }
  for (; k + N <= K; k += N) {
    const typename V::F w = V::weights(row + k);
    for (int t = 0; t < TT; ++t) acc[0][t] = V::fma(w, V::load(x + t * K + k), acc[0][t]);
  }
  for (int t = 0; t < TT; ++t) {
    typename V::F sum = acc[0][t];
    for (int a = 1; a < NA; ++a) sum = V::add(sum, acc[a][t]);
    float v = V::sum(sum);
    for (int64_t i = k; i < K; ++i) v += x[t * K + i] * static_cast<float>(row[i]);
    y[t * O] = v * scale;
  }
}

// R rows x TT tokens: each activation vector loaded serves R rows, each converted weight vector TT tokens (one
// row at a time, the loads, not the multiply-adds, would bound a batch).
template <int R, int TT, class V = VInt8>
inline void int8_block(const int8_t* w, int64_t K, const float* x, const float* scales, float* y, int64_t O) {
  constexpr int N = V::N;
  typename V::F acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = V::zero();
  int64_t k = 0;
  for (; k + N <= K; k += N) {
    typename V::F wv[R];
    for (int r = 0; r < R; ++r) wv[r] = V::weights(w + r * K + k);
    for (int t = 0; t < TT; ++t) {
      const typename V::F xv = V::load(x + t * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = V::fma(wv[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    for (int r = 0; r < R; ++r) {
      float v = V::sum(acc[r][t]);
      for (int64_t i = k; i < K; ++i) v += x[t * K + i] * static_cast<float>(w[r * K + i]);
      y[t * O + r] = v * scales[r];
    }
  }
}

// Rows [o0, o1) for TT tokens (all of x's K), kRows rows a block, the last rows one at a time.
template <int TT>
inline void int8_rows(const int8_t* w, int64_t K, const float* x, const float* scales, float* y, int64_t O,
                      int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + kInt8Rows <= o1; o += kInt8Rows) int8_block<kInt8Rows, TT>(w + o * K, K, x, scales + o, y + o, O);
  for (; o < o1; ++o) int8_block<1, TT>(w + o * K, K, x, scales + o, y + o, O);
}

// A batch of T >= 2 tokens: rows in chunks of kInt8Chunk; within a chunk the tokens in groups of kInt8Tokens,
// each group against every row of the chunk, so that the group's activations (kInt8Tokens x K floats) stay in L1
// while the chunk's rows (from L2 after the first group) pass over them.
inline void int8_batch(const int8_t* w, int64_t K, const float* x, int64_t T, const float* scales, float* y,
                       int64_t O, int64_t o0, int64_t o1) {
  for (int64_t c0 = o0; c0 < o1; c0 += kInt8Chunk) {
    const int64_t c1 = std::min(o1, c0 + kInt8Chunk);
    int64_t t = 0;
    for (; t + kInt8Tokens <= T; t += kInt8Tokens)
      int8_rows<kInt8Tokens>(w, K, x + t * K, scales, y + t * O, O, c0, c1);
    switch (T - t) {  // the last few tokens
      case 5: int8_rows<5>(w, K, x + t * K, scales, y + t * O, O, c0, c1); break;
      case 4: int8_rows<4>(w, K, x + t * K, scales, y + t * O, O, c0, c1); break;
      case 3: int8_rows<3>(w, K, x + t * K, scales, y + t * O, O, c0, c1); break;
      case 2: int8_rows<2>(w, K, x + t * K, scales, y + t * O, O, c0, c1); break;
      case 1: int8_rows<1>(w, K, x + t * K, scales, y + t * O, O, c0, c1); break;
      default: break;
    }
  }
}

}  // namespace qk

// y [T, O] = (x @ w.T) * scales; x [T, K] float32, w int8 [O, K], scales float32 [O].
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scales) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [T, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous CPU int8 [O, K]");
  TORCH_CHECK(w.size(1) == x.size(1), "w has ", w.size(1), " inputs, x ", x.size(1));
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == w.size(0) && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous() && scales.device().is_cpu(), "scales: contiguous CPU float32 [O]");
  const int64_t T = x.size(0), K = x.size(1), O = w.size(0);
  auto y = at::empty({T, O}, x.options());
  if (T == 0 || O == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, O, qk::grain_rows(K * T, 65536), [&](int64_t o0, int64_t o1) {
    if (T >= 2) {
      qk::int8_batch(wp, K, xp, T, sp, yp, O, o0, o1);
      return;
    }
    for (int64_t o = o0; o < o1; ++o) qk::int8_tile<1>(wp + o * K, K, xp, sp[o], yp + o, O);  // decode's GEMV
  });
  return y;
}
"""
