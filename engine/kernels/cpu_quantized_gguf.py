"""The C++ of the GGUF kernels (engine/kernels/cpu_quantized_linear.py says what they compute): Q8 activations,
the one-token GEMV and the batched paths over Q4_0/Q4_1/Q8_0 blocks as stored, one body compiled per dot-product
ISA (AVX2, AVX-VNNI, AVX-512 VNNI: `#pragma GCC target` sections, chosen at run time by CPUID, so the x86-64-v3
and -v4 builds both carry the VNNI paths; the AVX-512 body's 512-bit GEMV and lanes kernels are in
cpu_quantized_gguf_wide.py), and the entry points gguf_linear, quantize_q8, dot_isa.

SOURCE follows cpu_quantized_linear's common prelude (includes, qk::hsum, qk::grain_rows) in one extension.
"""

from __future__ import annotations

from engine.kernels.cpu_quantized_gguf_wide import GEMV_NARROW, GEMV_WIDE, LANES_NARROW, LANES_WIDE

FUNCTIONS = ("gguf_linear", "quantize_q8", "dot_isa")

_HELPERS = r"""
namespace qk {
constexpr int64_t QK = 32;  // values per block (GGUF and Q8 activations)
enum : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

constexpr int64_t block_bytes(int64_t fmt) { return fmt == kQ4_0 ? 18 : fmt == kQ4_1 ? 20 : 34; }

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One block of 32 floats -> 32 int8 q, d = max|x| / 127, s = d * sum(q). The same float32 operations as
// quantize_activations_q8 in torch (one multiply by 1/d, round half to even), so the same bits.
inline void quantize_block_q8(const float* x, int8_t* q, float* d_out, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
  const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const __m256 inv = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));  // MXCSR's default: round half to even
  __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  i0 = _mm256_packs_epi32(i0, i1);  // 0-3 8-11 4-7 12-15
  i2 = _mm256_packs_epi32(i2, i3);  // 16-19 24-27 20-23 28-31
  i0 = _mm256_packs_epi16(i0, i2);  // 0-3 8-11 16-19 24-27 4-7 12-15 20-23 28-31
  i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i0);
  *d_out = d;
  *s_out = d * static_cast<float>(_mm_cvtsi128_si32(t4));
}

// x [T, K] -> q [T, K], d [T, K/32], s [T, K/32].
inline void quantize_rows_q8(const float* x, int64_t T, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / QK;
  at::parallel_for(0, T * nb, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_block_q8(x + i * QK, q + i * QK, d + i, s + i);
  });
}

inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float v = hsum(acc);
  for (; i < n; ++i) v += a[i] * b[i];
  return v;
}

// Tokens in lanes, for the batched VNNI path: 8 tokens' Q8 activations per tile, transposed so that one 32-byte
// vector holds the same 4 values (a "group") of 8 tokens, one token per int32 lane:
//
//     xt[tile][b][g] = | t0: q[b*32 + 4g .. +3] | t1: ... | ... | t7: ... |        g = 0..7, 32 bytes each
//     dt, st[tile][b] = d, d * sum(q) of tokens t0..t7;  ct[tile][b] = -offset * sum(q) (int32)
//
// Then one vpdpbusd of a block's 4 weight codes (broadcast) against xt[tile][b][g] adds those 4 products for all
// 8 tokens, and a block's scales apply once per 8 tokens instead of once per token.
inline void transpose_tiles(const int8_t* q, const float* d, const float* s, int64_t num_tiles, int64_t K,
                            int32_t offset, uint8_t* xt, float* dt, float* st, int32_t* ct) {
  const int64_t nb = K / QK;
  at::parallel_for(0, num_tiles * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = i / nb, b = i % nb;
      __m256i r[8];
      for (int t = 0; t < 8; ++t) {
        const int64_t token = tile * 8 + t;
        r[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + token * K + b * QK));
        dt[i * 8 + t] = d[token * nb + b];
        st[i * 8 + t] = s[token * nb + b];
        // sum of the 32 int8 values: |sum| <= 32 * 127, exact
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), r[t]);
        const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        __m128i v = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
        v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
        v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
        ct[i * 8 + t] = -offset * _mm_cvtsi128_si32(v);
      }
      // 8 x 8 transpose of int32: row t (token) -> row g (group)
      const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
      const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
      const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
      const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
      const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
      const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
      const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
      __m256i* out = reinterpret_cast<__m256i*>(xt + i * 256);
      _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
      _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
      _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
      _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
      _mm256_storeu_si256(out + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
      _mm256_storeu_si256(out + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
      _mm256_storeu_si256(out + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
      _mm256_storeu_si256(out + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
    }
  });
}

// 32 nibbles of a Q4 block: byte j's low nibble is value j, its high nibble value j + 16.
inline __m256i unpack_nibbles(const uint8_t* p) {
  // the 16 bytes in both halves (a load), the upper half shifted down a nibble, then the low nibbles of all
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// The f16 pair at p (a block's d, and Q4_1's m) as floats in lanes 0 and 1.
inline __m128 f16_pair(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}

}  // namespace qk
"""

# Compiled once per dot-product ISA, inside `#pragma GCC target` for the VNNI ones (chosen at run time by CPUID,
# so the x86-64-v3 and -v4 builds both carry the VNNI paths). @NS@ and @DOT@ are filled in below.
_GGUF_BODY = r"""
namespace @NS@ {
using namespace qk;

// Σ over groups of 4 of u8 x s8 products, into 8 int32 lanes.
inline __m256i dot_u8s8(__m256i u, __m256i s) { return @DOT@; }
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return @DOT_ACC@; }

// A block's codes as u8 (what vpdpbusd multiplies) and, for the signed formats, the signed codes (whose signs
// move onto the activations).
template <int64_t FMT>
inline void load_codes(const uint8_t* blk, __m256i& u, __m256i& w) {
  if constexpr (FMT == kQ8_0) {
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    u = _mm256_abs_epi8(w);
  } else if constexpr (FMT == kQ4_0) {
    w = _mm256_sub_epi8(unpack_nibbles(blk + 2), _mm256_set1_epi8(8));
    u = _mm256_abs_epi8(w);
  } else {
    u = unpack_nibbles(blk + 4);
    w = u;
  }
}

// Block b of one row against TT tokens: acc[t] += dw[b] dx[t, b] dot(b, t), 8 lanes of partial sums. The scales
// are broadcast from memory (loads, not shuffles), one multiply each.
template <int64_t FMT, int TT>
inline void block(const uint8_t* row, int64_t b, int64_t nb, const int8_t* qx, const float* dx, const float* dw,
                  int64_t K, __m256* acc) {
  __m256i u, w;
  load_codes<FMT>(row + b * block_bytes(FMT), u, w);
  const __m256 dwv = _mm256_broadcast_ss(dw + b);
  for (int t = 0; t < TT; ++t) {
    __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * QK));
    if constexpr (FMT != kQ4_1) s = _mm256_sign_epi8(s, w);
    const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(u, s));
    acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dwv, _mm256_broadcast_ss(dx + t * nb + b)), acc[t]);
  }
}

// Rows of one output row for TT tokens: y[tt * O] = Σ_b dw[b] dx[tt, b] dot(b) (+ Σ_b mw[b] sx[tt, b]).
// NA accumulators per token take alternate blocks, so that a single token does not wait on one FMA chain.
template <int64_t FMT, int TT>
inline void tile(const uint8_t* row, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
                 const float* dw, const float* mw, int64_t K, float* y, int64_t O) {
  constexpr int NA = TT == 1 ? 4 : TT == 2 ? 2 : 1;
  __m256 acc[NA][TT];
  for (int a = 0; a < NA; ++a)
    for (int t = 0; t < TT; ++t) acc[a][t] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + NA <= nb; b += NA) {
    for (int a = 0; a < NA; ++a) {
      block<FMT, TT>(row, b + a, nb, qx, dx, dw, K, acc[a]);
    }
  }
  for (; b < nb; ++b) {
    block<FMT, TT>(row, b, nb, qx, dx, dw, K, acc[0]);
  }
  for (int t = 0; t < TT; ++t) {
    __m256 sum = acc[0][t];
    for (int a = 1; a < NA; ++a) sum = _mm256_add_ps(sum, acc[a][t]);
    float v = hsum(sum);
    if constexpr (FMT == kQ4_1) v += dot_f32(mw, sx + t * nb, nb);
    y[t * O] = v;
  }
}

// One token (decode's GEMV): the scales straight from the block, no per-row pass over them. dsx: [nb][2] the
// token's (d, d * sum(q)) per block. Two accumulators take alternate blocks.
template <int64_t FMT>
inline void gemv_block(const uint8_t* row, int64_t b, const int8_t* qx, const float* dsx, __m256& acc,
                       __m128& macc) {
  const uint8_t* blk = row + b * block_bytes(FMT);
  __m256i u, w;
  load_codes<FMT>(blk, u, w);
  __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + b * QK));
  if constexpr (FMT != kQ4_1) s = _mm256_sign_epi8(s, w);
  const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(u, s));
  const __m128 xs = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dsx + 2 * b)));
  const __m128 p = _mm_mul_ps(f16_pair(blk), xs);  // (dw dx, m sx): lane 1 is Q4_1's, garbage otherwise
  if constexpr (FMT == kQ4_1) macc = _mm_add_ps(macc, p);
  acc = _mm256_fmadd_ps(dot, _mm256_broadcastss_ps(p), acc);
}

template <int64_t FMT>
inline float gemv_row(const uint8_t* row, int64_t nb, const int8_t* qx, const float* dsx) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m128 macc[2] = {_mm_setzero_ps(), _mm_setzero_ps()};  // lane 1: Q4_1's Σ m sx
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    gemv_block<FMT>(row, b, qx, dsx, acc[0], macc[0]);
    gemv_block<FMT>(row, b + 1, qx, dsx, acc[1], macc[1]);
  }
  if (b < nb) gemv_block<FMT>(row, b, qx, dsx, acc[0], macc[0]);
  float v = hsum(_mm256_add_ps(acc[0], acc[1]));
  if constexpr (FMT == kQ4_1) {
    const __m128 m = _mm_add_ps(macc[0], macc[1]);
    v += _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1));
  }
  return v;
}
@WIDE_GEMV@
template <int64_t FMT>
void rows_of(const uint8_t* w, int64_t K, const int8_t* qx, const float* dx, const float* sx, int64_t T,
             float* y, int64_t O, int64_t o0, int64_t o1) {
  constexpr int64_t BB = block_bytes(FMT);
  const int64_t nb = K / QK;
  if (T == 1) {
    std::vector<float> dsx(2 * nb);
    for (int64_t b = 0; b < nb; ++b) {
      dsx[2 * b] = dx[b];
      dsx[2 * b + 1] = sx[b];
    }
    for (int64_t o = o0; o < o1; ++o) y[o] = gemv_row_wide<FMT>(w + o * nb * block_bytes(FMT), nb, qx, dsx.data());
    return;
  }
  std::vector<float> dw(nb), mw(nb);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = w + o * nb * BB;
    for (int64_t b = 0; b < nb; ++b) {
      dw[b] = f16_at(row + b * BB);
      if constexpr (FMT == kQ4_1) mw[b] = f16_at(row + b * BB + 2);
    }
    int64_t t = 0;
    auto run = [&](auto tt) {
      constexpr int n = decltype(tt)::value;
      tile<FMT, n>(row, nb, qx + t * K, dx + t * nb, sx + t * nb, dw.data(), mw.data(), K, y + t * O + o, O);
      t += n;
    };
    while (T - t >= 8) run(std::integral_constant<int, 8>{});
    if (T - t >= 4) run(std::integral_constant<int, 4>{});
    if (T - t >= 2) run(std::integral_constant<int, 2>{});
    if (T - t >= 1) run(std::integral_constant<int, 1>{});
  }
}

// A tile's block b into its 8 tokens' sums: acc += dot x dw[b] dx[t, b] (+ Q4_1's m[b] sx[t, b]).
template <int64_t FMT>
inline __m256 lane_scale(__m256 acc, __m256i dot, __m256 dwv, const uint8_t* blk, const float* dt, const float* st) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dwv, _mm256_loadu_ps(dt)), acc);
  if constexpr (FMT == kQ4_1) acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(blk + 2)), _mm256_loadu_ps(st), acc);
  return acc;
}

// NT tiles' sums (8 tokens each, one output row) into y, tokens O floats apart.
template <int NT>
inline void store_tiles(const __m256* acc, float* y, int64_t O) {
  alignas(32) float out[8];
  for (int n = 0; n < NT; ++n) {
    _mm256_store_ps(out, acc[n]);
    for (int t = 0; t < 8; ++t) y[(n * 8 + t) * O] = out[t];
  }
}

// A block's 32 codes as unsigned bytes for the lanes path: Q4_0/Q4_1's nibbles, Q8_0's int8 + 128.
template <int64_t FMT>
inline __m256i lane_codes(const uint8_t* blk) {
  if constexpr (FMT == kQ8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), _mm256_set1_epi8(-128));
  } else {
    return unpack_nibbles(blk + (FMT == kQ4_1 ? 4 : 2));
  }
}

// Tokens in lanes (see transpose_tiles): NT tiles of 8 tokens against one row. The codes are unsigned here (Q4_0's
// nibbles, Q8_0's int8 + 128), the offset taken back exactly by starting each dot at ct = -offset * sum(q). Needs
// an unsaturated u8 x s8 dot (VNNI): maddubs's int16 pairs would overflow on Q8_0's codes.
template <int64_t FMT, int NT>
inline void lanes(const uint8_t* row, int64_t nb, const uint8_t* xt, const float* dt, const float* st,
                  const int32_t* ct, float* y, int64_t O) {
  constexpr int64_t BB = block_bytes(FMT);
  alignas(32) int32_t codes[8];
  __m256 acc[NT];
  for (int n = 0; n < NT; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * BB;
    const __m256i u = lane_codes<FMT>(blk);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), u);
    const __m256 dwv = _mm256_set1_ps(f16_at(blk));
    for (int n = 0; n < NT; ++n) {
      const int64_t tb = n * nb + b;  // this tile's block b
      const __m256i* x = reinterpret_cast<const __m256i*>(xt + tb * 256);
      __m256i dot = FMT == kQ4_1 ? _mm256_setzero_si256()
                                 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ct + tb * 8));
      for (int g = 0; g < 8; ++g) dot = dot_acc(dot, _mm256_set1_epi32(codes[g]), _mm256_loadu_si256(x + g));
      acc[n] = lane_scale<FMT>(acc[n], dot, dwv, blk, dt + tb * 8, st + tb * 8);
    }
  }
  store_tiles<NT>(acc, y, O);
}

@WIDE_LANES@
// Rows in chunks, and within a chunk the tiles in groups of up to 4 (2 for rows of more than 32 blocks), each group
// against every row of the chunk: a group's activations (tiles x nb x 256 bytes) stay in L1 while the chunk's rows pass over them, and a prefill's
// many tiles are read once a chunk instead of once a row. A chunk's outputs go to a buffer first and then to y a
// token's run of rows at a time: written straight to y, one row's 8 tokens a tile land O floats apart, which for
// O a multiple of 1,024 (gate_up, the LM head) is one L1 set, evicting itself.
template <int64_t FMT>
void lane_rows_of(const uint8_t* w, int64_t K, const uint8_t* xt, const float* dt, const float* st,
                  const int32_t* ct, int64_t num_tiles, float* y, int64_t O, int64_t o0, int64_t o1) {
  constexpr int64_t kChunk = 16, kGroupBlocks = 32;  // 4 tiles of 32 blocks: 32 KiB of activations
  const int64_t nb = K / QK, tokens = num_tiles * 8;
  std::vector<float> buf(tokens * kChunk);
  for (int64_t r0 = o0; r0 < o1; r0 += kChunk) {
    const int64_t r1 = std::min(o1, r0 + kChunk);
    int64_t tile = 0;
    auto run = [&](auto nt) {
      constexpr int n = decltype(nt)::value;
      const int64_t at = tile * nb;
      for (int64_t o = r0; o < r1; ++o)
        lanes_best<FMT, n>(w + o * nb * block_bytes(FMT), nb, xt + at * 256, dt + at * 8, st + at * 8, ct + at * 8,
                           buf.data() + tile * 8 * kChunk + (o - r0), kChunk);
      tile += n;
    };
    if (nb <= kGroupBlocks)
      while (num_tiles - tile >= 4) run(std::integral_constant<int, 4>{});
    while (num_tiles - tile >= 2) run(std::integral_constant<int, 2>{});
    if (num_tiles - tile >= 1) run(std::integral_constant<int, 1>{});
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(y + t * O + r0, buf.data() + t * kChunk, (r1 - r0) * sizeof(float));
  }
}

void gguf_lane_rows(int64_t fmt, const uint8_t* w, int64_t K, const uint8_t* xt, const float* dt, const float* st,
                    const int32_t* ct, int64_t num_tiles, float* y, int64_t O, int64_t o0, int64_t o1) {
  if (fmt == kQ4_0) lane_rows_of<kQ4_0>(w, K, xt, dt, st, ct, num_tiles, y, O, o0, o1);
  else if (fmt == kQ4_1) lane_rows_of<kQ4_1>(w, K, xt, dt, st, ct, num_tiles, y, O, o0, o1);
  else lane_rows_of<kQ8_0>(w, K, xt, dt, st, ct, num_tiles, y, O, o0, o1);
}

void gguf_rows(int64_t fmt, const uint8_t* w, int64_t K, const int8_t* qx, const float* dx, const float* sx,
               int64_t T, float* y, int64_t O, int64_t o0, int64_t o1) {
  if (fmt == kQ4_0) rows_of<kQ4_0>(w, K, qx, dx, sx, T, y, O, o0, o1);
  else if (fmt == kQ4_1) rows_of<kQ4_1>(w, K, qx, dx, sx, T, y, O, o0, o1);
  else rows_of<kQ8_0>(w, K, qx, dx, sx, T, y, O, o0, o1);
}

}  // namespace @NS@
"""

_ISAS = (  # namespace, GCC target ("" = the variant's own), the dot product, the dot product added to acc, the GEMV,
    # the lanes kernel
    ("isa_avx2", "", "_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))",
     "_mm256_add_epi32(acc, dot_u8s8(u, s))", GEMV_NARROW,
     LANES_NARROW),  # saturates on Q8_0's offset codes: lanes need VNNI
    ("isa_avxvnni", "avxvnni", "_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)",
     "_mm256_dpbusd_avx_epi32(acc, u, s)", GEMV_NARROW, LANES_NARROW),
    ("isa_avx512vnni", "avx512f,avx512bw,avx512vl,avx512vnni", "_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)",
     "_mm256_dpbusd_epi32(acc, u, s)", GEMV_WIDE, LANES_WIDE),
)


def _instantiate(ns: str, target: str, dot: str, dot_acc: str, gemv: str, lanes: str) -> str:
    body = (_GGUF_BODY.replace("@NS@", ns).replace("@DOT_ACC@", dot_acc).replace("@DOT@", dot)
            .replace("@WIDE_GEMV@", gemv).replace("@WIDE_LANES@", lanes))
    if not target:
        return body
    return f'#pragma GCC push_options\n#pragma GCC target("{target}")\n{body}#pragma GCC pop_options\n'




_ENTRY_POINTS = r"""
namespace qk {

using RowsFn = void (*)(int64_t, const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t,
                        float*, int64_t, int64_t, int64_t);

inline bool isa_available(int64_t isa) {
  __builtin_cpu_init();
  switch (isa) {
    case 0: return true;
    case 1: return __builtin_cpu_supports("avxvnni");
    case 2: return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512bw");
    default: return false;
  }
}

inline int64_t best_isa() {
  static const int64_t best = isa_available(2) ? 2 : isa_available(1) ? 1 : 0;
  return best;
}

using LaneRowsFn = void (*)(int64_t, const uint8_t*, int64_t, const uint8_t*, const float*, const float*,
                            const int32_t*, int64_t, float*, int64_t, int64_t, int64_t);

inline LaneRowsFn lane_rows_for(int64_t isa) {  // null: no lanes path (AVX2's dot saturates)
  if (isa < 0) isa = best_isa();
  return isa == 2 ? isa_avx512vnni::gguf_lane_rows : isa == 1 ? isa_avxvnni::gguf_lane_rows : nullptr;
}

inline RowsFn rows_for(int64_t isa) {
  if (isa < 0) isa = best_isa();
  TORCH_CHECK(isa_available(isa), "this CPU cannot run dot-product ISA ", isa);
  return isa == 2 ? isa_avx512vnni::gguf_rows : isa == 1 ? isa_avxvnni::gguf_rows : isa_avx2::gguf_rows;
}

}  // namespace qk

// The Q8 activations of x [T, K] float32: (q int8 [T, K], d float32 [T, K/32]).
std::tuple<at::Tensor, at::Tensor> quantize_q8(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [T, K] float32");
  TORCH_CHECK(x.size(1) % qk::QK == 0, "x: K must be a multiple of 32");
  const int64_t T = x.size(0), K = x.size(1);
  auto q = at::empty({T, K}, x.options().dtype(at::kChar));
  auto d = at::empty({T, K / qk::QK}, x.options());
  auto s = at::empty({T, K / qk::QK}, x.options());
  qk::quantize_rows_q8(x.data_ptr<float>(), T, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  return {q, d};
}

// y [T, O] = q8(x) @ dequantize(w).T; w: uint8 [O, K/32 * block bytes], GGUF blocks as stored; fmt 0/1/2 =
// Q4_0/Q4_1/Q8_0; isa -1 = the best this CPU runs.
at::Tensor gguf_linear(at::Tensor x, at::Tensor w, int64_t fmt, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(fmt >= qk::kQ4_0 && fmt <= qk::kQ8_0, "unknown GGUF format code ", fmt);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [T, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous CPU uint8 [O, bytes]");
  const int64_t T = x.size(0), K = x.size(1), O = w.size(0), nb = K / qk::QK;
  TORCH_CHECK(K > 0 && K % qk::QK == 0, "x: K = ", K, " is not a positive multiple of 32");
  TORCH_CHECK(w.size(1) == nb * qk::block_bytes(fmt), "w: ", w.size(1), " bytes a row, ", K, " inputs need ",
              nb * qk::block_bytes(fmt));
  const qk::RowsFn rows = qk::rows_for(isa);
  auto y = at::empty({T, O}, x.options());
  if (T == 0 || O == 0) return y;
  // The Q8 activations, in buffers this thread keeps (a GEMV is a few microseconds: allocations show).
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> ds;
  q.resize(T * K);
  ds.resize(2 * T * nb);
  const int8_t* qp = q.data();
  const float* dp = ds.data();
  const float* sp = ds.data() + T * nb;
  qk::quantize_rows_q8(x.data_ptr<float>(), T, K, q.data(), ds.data(), ds.data() + T * nb);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Whole tiles of 8 tokens go through the lanes path where the CPU has VNNI; the rest token by token.
  const qk::LaneRowsFn lane_rows = qk::lane_rows_for(isa);
  const int64_t num_tiles = lane_rows != nullptr ? T / 8 : 0, tiled = num_tiles * 8;
  thread_local std::vector<uint8_t> xt;
  thread_local std::vector<float> dst;
  thread_local std::vector<int32_t> ct;
  if (num_tiles > 0) {
    xt.resize(num_tiles * nb * 256);
    dst.resize(2 * num_tiles * nb * 8);
    ct.resize(num_tiles * nb * 8);
    const int32_t offset = fmt == qk::kQ4_0 ? 8 : fmt == qk::kQ8_0 ? 128 : 0;
    qk::transpose_tiles(qp, dp, sp, num_tiles, K, offset, xt.data(), dst.data(), dst.data() + num_tiles * nb * 8,
                        ct.data());
  }
  const uint8_t* xtp = xt.data();
  const float* dtp = dst.data();
  const float* stp = dst.data() + num_tiles * nb * 8;
  const int32_t* ctp = ct.data();
  at::parallel_for(0, O, qk::grain_rows(nb * T, 4096), [&](int64_t o0, int64_t o1) {
    if (num_tiles > 0) lane_rows(fmt, wp, K, xtp, dtp, stp, ctp, num_tiles, yp, O, o0, o1);
    if (T > tiled) rows(fmt, wp, K, qp + tiled * K, dp + tiled * nb, sp + tiled * nb, T - tiled, yp + tiled * O, O,
                        o0, o1);
  });
  return y;
}

// The dot-product ISA `isa` names (-1: the one picked), or "" where this CPU cannot run it.
std::string dot_isa(int64_t isa) {
  if (isa < 0) isa = qk::best_isa();
  if (!qk::isa_available(isa)) return "";
  return isa == 2 ? "avx512vnni" : isa == 1 ? "avxvnni" : "avx2";
}
"""

SOURCE = _HELPERS + "".join(_instantiate(*isa) for isa in _ISAS) + _ENTRY_POINTS
