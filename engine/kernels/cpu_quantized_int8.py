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
constexpr int kInt8PairTokens = 8;  // 2 rows x 8 tokens of accumulators in 32 registers
#else
using VInt8 = V256;
constexpr int kInt8PairTokens = 4;  // 2 x 4 in 16
#endif

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

// Two rows x TT tokens: each activation vector is loaded once for both rows (one row at a time, the loads, not
// the multiply-adds, would bound a batch).
template <int TT, class V = VInt8>
inline void int8_tile2(const int8_t* r0, const int8_t* r1, int64_t K, const float* x, float s0, float s1, float* y,
                       int64_t O) {
  constexpr int N = V::N;
  typename V::F a0[TT], a1[TT];
  for (int t = 0; t < TT; ++t) a0[t] = a1[t] = V::zero();
  int64_t k = 0;
  for (; k + N <= K; k += N) {
    const typename V::F w0 = V::weights(r0 + k), w1 = V::weights(r1 + k);
    for (int t = 0; t < TT; ++t) {
      const typename V::F xv = V::load(x + t * K + k);
      a0[t] = V::fma(w0, xv, a0[t]);
      a1[t] = V::fma(w1, xv, a1[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    float v0 = V::sum(a0[t]), v1 = V::sum(a1[t]);
    for (int64_t i = k; i < K; ++i) {
      v0 += x[t * K + i] * static_cast<float>(r0[i]);
      v1 += x[t * K + i] * static_cast<float>(r1[i]);
    }
    y[t * O] = v0 * s0;
    y[t * O + 1] = v1 * s1;
  }
}

}  // namespace qk

// y [T, O] = (x @ w.T) * scales; x [T, K] float32, w int8 [O, K], scales float32 [O].
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous [T, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous CPU int8 [O, K]");
  TORCH_CHECK(w.size(1) == x.size(1), "w has ", w.size(1), " inputs, x ", x.size(1));
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == w.size(0) && scales.scalar_type() == torch::kFloat32 &&
              scales.is_contiguous() && scales.device().is_cpu(), "scales: contiguous CPU float32 [O]");
  const int64_t T = x.size(0), K = x.size(1), O = w.size(0);
  auto y = torch::empty({T, O}, x.options());
  if (T == 0 || O == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, O, qk::grain_rows(K * T, 65536), [&](int64_t o0, int64_t o1) {
    int64_t o = o0;
    for (; T >= qk::kInt8PairTokens && o + 2 <= o1; o += 2) {  // batches: pairs of rows
      int64_t t = 0;
      for (; T - t >= qk::kInt8PairTokens; t += qk::kInt8PairTokens)
        qk::int8_tile2<qk::kInt8PairTokens>(wp + o * K, wp + (o + 1) * K, K, xp + t * K, sp[o], sp[o + 1],
                                            yp + t * O + o, O);
      for (; t < T; ++t) {
        qk::int8_tile<1>(wp + o * K, K, xp + t * K, sp[o], yp + t * O + o, O);
        qk::int8_tile<1>(wp + (o + 1) * K, K, xp + t * K, sp[o + 1], yp + t * O + o + 1, O);
      }
    }
    for (; o < o1; ++o) {
      const int8_t* row = wp + o * K;
      int64_t t = 0;
      for (; T - t >= 8; t += 8) qk::int8_tile<8>(row, K, xp + t * K, sp[o], yp + t * O + o, O);
      if (T - t >= 4) { qk::int8_tile<4>(row, K, xp + t * K, sp[o], yp + t * O + o, O); t += 4; }
      if (T - t >= 2) { qk::int8_tile<2>(row, K, xp + t * K, sp[o], yp + t * O + o, O); t += 2; }
      if (T - t >= 1) qk::int8_tile<1>(row, K, xp + t * K, sp[o], yp + t * O + o, O);
    }
  });
  return y;
}
"""
