"""The GGUF kernels' 512-bit variants (engine/kernels/cpu_quantized_gguf.py fills them into its AVX-512 VNNI body;
the narrower ISAs get the forwarding versions): the one-token GEMV two blocks to a vector, and the lanes path two
groups of a tile to a vector. On cores that run a 512-bit vpdpbusd at a 256-bit one's rate (Zen 5) each does twice
the multiply-adds an instruction.
"""

from __future__ import annotations

GEMV_WIDE = r"""
// The GEMV two blocks to a 512-bit vector (Zen 5 runs them at full width): codes, activations, one vpdpbusd, and
// the two blocks' scales as one vector (lanes 0-7 block b, 8-15 block b + 1).
template <int64_t FMT>
inline float gemv_row_wide(const uint8_t* row, int64_t nb, const int8_t* qx, const float* dsx) {
  constexpr int64_t BB = block_bytes(FMT);
  const __m512i shifts = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m128 macc[2] = {_mm_setzero_ps(), _mm_setzero_ps()};  // lanes 1 and 3: Q4_1's Σ m sx
  auto pair = [&](int64_t b, int a) {
    const uint8_t* b0 = row + b * BB;
    const uint8_t* b1 = b0 + BB;
    __m512i u, w;
    if constexpr (FMT == kQ8_0) {
      w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
      u = _mm512_abs_epi8(w);
    } else {
      constexpr int64_t at = FMT == kQ4_1 ? 4 : 2;
      const __m256i n0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + at)));
      const __m256i n1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + at)));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(n0), n1, 1);
      u = _mm512_and_si512(_mm512_srlv_epi64(both, shifts), low);
      if constexpr (FMT == kQ4_0) {
        w = _mm512_sub_epi8(u, _mm512_set1_epi8(8));
        u = _mm512_abs_epi8(w);
      }
    }
    __m512i s = _mm512_loadu_si512(qx + b * QK);
    if constexpr (FMT != kQ4_1)  // sign(s, w): w's zeros meet |w| = 0, so negating where w < 0 is enough
      s = _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s);
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s));
    int32_t h0, h1;
    std::memcpy(&h0, b0, 4);
    std::memcpy(&h1, b1, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1));  // d0 m0 d1 m1
    const __m128 p = _mm_mul_ps(dm, _mm_loadu_ps(dsx + 2 * b));                       // x (dx0 sx0 dx1 sx1)
    if constexpr (FMT == kQ4_1) macc[a] = _mm_add_ps(macc[a], p);
    acc[a] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(p)), acc[a]);
  };
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    pair(b, 0);
    pair(b + 2, 1);
  }
  if (b + 2 <= nb) {
    pair(b, 0);
    b += 2;
  }
  __m256 acc1 = _mm256_setzero_ps();
  __m128 macc1 = _mm_setzero_ps();
  if (b < nb) gemv_block<FMT>(row, b, qx, dsx, acc1, macc1);
  float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + hsum(acc1);
  if constexpr (FMT == kQ4_1) {
    const __m128 m = _mm_add_ps(macc[0], macc[1]);
    v += _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 3)) +
         _mm_cvtss_f32(_mm_shuffle_ps(macc1, macc1, 1));
  }
  return v;
}
"""
GEMV_NARROW = r"""
template <int64_t FMT>
inline float gemv_row_wide(const uint8_t* row, int64_t nb, const int8_t* qx, const float* dsx) {
  return gemv_row<FMT>(row, nb, qx, dsx);  // no 512-bit vectors here
}
"""

LANES_WIDE = r"""
// The lanes path two groups to a 512-bit vector (cores that run a 512-bit vpdpbusd at a 256-bit one's rate do
// twice the multiply-adds a cycle): a tile's groups g and g + 1 are 64 contiguous bytes, one load, and the block's
// codes of those groups, broadcast to lanes 0-7 and 8-15 once a block, serve every tile; the two halves (the same
// 8 tokens) are added before the scales. Two chains of dot products a tile, for vpdpbusd's latency.
template <int64_t FMT, int NT>
inline void lanes_best(const uint8_t* row, int64_t nb, const uint8_t* xt, const float* dt, const float* st,
                       const int32_t* ct, float* y, int64_t O) {
  constexpr int64_t BB = block_bytes(FMT);
  const __m512i pick[4] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                           _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
                           _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
                           _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7)};
  __m256 acc[NT];
  for (int n = 0; n < NT; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * BB;
    const __m256i u = lane_codes<FMT>(blk);
    const __m512i uz = _mm512_castsi256_si512(u);
    __m512i c[4];
    for (int k = 0; k < 4; ++k) c[k] = _mm512_permutexvar_epi32(pick[k], uz);
    const __m256 dwv = _mm256_set1_ps(f16_at(blk));
    for (int n = 0; n < NT; ++n) {
      const int64_t tb = n * nb + b;  // this tile's block b
      const uint8_t* x = xt + tb * 256;
      __m512i d0 = FMT == kQ4_1 ? _mm512_setzero_si512()
                                : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ct + tb * 8)));
      __m512i d1 = _mm512_setzero_si512();
      d0 = _mm512_dpbusd_epi32(d0, c[0], _mm512_loadu_si512(x));
      d1 = _mm512_dpbusd_epi32(d1, c[1], _mm512_loadu_si512(x + 64));
      d0 = _mm512_dpbusd_epi32(d0, c[2], _mm512_loadu_si512(x + 128));
      d1 = _mm512_dpbusd_epi32(d1, c[3], _mm512_loadu_si512(x + 192));
      const __m512i d = _mm512_add_epi32(d0, d1);
      const __m256i dot = _mm256_add_epi32(_mm512_castsi512_si256(d), _mm512_extracti64x4_epi64(d, 1));
      acc[n] = lane_scale<FMT>(acc[n], dot, dwv, blk, dt + tb * 8, st + tb * 8);
    }
  }
  store_tiles<NT>(acc, y, O);
}
"""
LANES_NARROW = r"""
template <int64_t FMT, int NT>
inline void lanes_best(const uint8_t* row, int64_t nb, const uint8_t* xt, const float* dt, const float* st,
                       const int32_t* ct, float* y, int64_t O) {
  lanes<FMT, NT>(row, nb, xt, dt, st, ct, y, O);  // no 512-bit vectors here
}
"""
