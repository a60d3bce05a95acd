"""y = x @ W.T for a quantized W on CPUs (engine/kernels/quantized_weight.py): GGUF's Q4_0, Q4_1 and Q8_0 blocks as
stored, and int8 per output channel, read in place, never dequantized to a float matrix.

Decode is bandwidth-bound: a step reads every weight once. These kernels read a Q4_1 weight at 5 bits a value
(an int8 one at 8) instead of float32's 32, and dequantize inside the dot product.

    GGUF (Q4_0, Q4_1, Q8_0), as llama.cpp computes them:
        the activation row is quantized to Q8 per block of 32 (quantize_activations_q8: d_x = max|x| / 127,
        q_x = round-half-even(x · (1 / d_x))), then per output row o and token t, over the row's blocks b:
            y[t, o] = Σ_b  d_w[b] · d_x[t, b] · Σ_i q_w[b, i] · q_x[t, b, i]        integer dot products
                    (+ Σ_b  m_w[b] · d_x[t, b] · Σ_i q_x[t, b, i]                   Q4_1's minimum term)
        with q_w the block's codes (Q4_0: nibble - 8; Q4_1: nibble; Q8_0: the int8). The integer dots are exact
        (u8 x s8 multiply-adds: VNNI's vpdpbusd where the CPU has it, else AVX2's maddubs + madd; signed weights
        go through |w| and sign(q_x, w), or in the batched lanes path as unsigned codes whose offset is taken
        back from each token's integer block sum), the rest is float32. That is q8(x) @ dequantize(W).T up to float32
        summation order: quantized_linear_torch computes it in torch, and the tests hold the kernel to it.
        Against x @ dequantize(W).T the activation rounding adds at most d_x / 2 a value:
            |y - y_ref|[t, o] ≤ ½ Σ_b d_x[t, b] Σ_{i in b} |W[o, i]|   (+ float32 rounding)
    INT8 (weight-only): activations stay float32, each weight converted to float in registers:
            y[t, o] = scale[o] · Σ_i x[t, i] · q[o, i]

Work is split over output rows with at::parallel_for (torch's thread count):

    one token (decode's GEMV)   a row's blocks in turn, each block's dot in 8 int32 lanes (two blocks to a 512-bit
                                vector with AVX-512 VNNI)
    batches, VNNI CPUs          whole tiles of 8 tokens with the tokens in the lanes (transpose_tiles: one
                                vpdpbusd of 4 broadcast weight codes covers 8 tokens, two groups to a 512-bit
                                vector with AVX-512 VNNI, and a block's scales apply once per 8 tokens, not per
                                token), rows in chunks of 16 against groups of tiles held in L1; the leftover
                                tokens as below
    batches, AVX2 only          the one-token code, up to 8 tokens a pass over a row
    INT8 batches                4 rows x 6 tokens of accumulators (2 x 4 on AVX2), rows in chunks of 64 against
                                groups of tokens held in L1

The C++ is in cpu_quantized_gguf.py and cpu_quantized_int8.py, built as one extension. `quantized_linear` runs
the kernel, or quantized_linear_torch (the same contract, slowly) when the C++ module is not built; bfloat16
activations are computed in float32 and the result is cast back.
"""

from __future__ import annotations

from functools import cache

import torch

from engine.kernels import cpu_quantized_gguf, cpu_quantized_int8
from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight, quantized_linear_torch
from kv_transfer import native_build
from kv_transfer.native_build import NativeModule

# ISA choices for the GGUF dot product (the `isa` argument): -1 picks the best this CPU runs.
ISA_AUTO, ISA_AVX2, ISA_AVXVNNI, ISA_AVX512VNNI = -1, 0, 1, 2
ISA_NAMES = {ISA_AVX2: "avx2", ISA_AVXVNNI: "avxvnni", ISA_AVX512VNNI: "avx512vnni"}

_COMMON = r"""
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace qk {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows per work item: at least `work` multiply-adds, so that small GEMVs do not pay for waking threads.
inline int64_t grain_rows(int64_t per_row, int64_t work) {
  return std::max<int64_t>(1, work / std::max<int64_t>(1, per_row));
}

}  // namespace qk
"""

NATIVE = NativeModule(
    name="cpu_quantized_linear",
    source=_COMMON + cpu_quantized_gguf.SOURCE + cpu_quantized_int8.SOURCE,
    functions=cpu_quantized_gguf.FUNCTIONS + cpu_quantized_int8.FUNCTIONS,
)


@cache
def load_kernel():  # noqa: ANN201 - the compiled extension module, or None
    """The compiled kernels, or None (see kv_transfer/native_build.py)."""
    return native_build.load(NATIVE)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, *, isa: int = ISA_AUTO) -> torch.Tensor:
    """y = x @ W.T, W = `weight` (see the module docstring for what is computed): x [..., in_features] float32 or
    bfloat16 -> [..., out_features] in x's dtype. `isa` picks the GGUF dot product (tests and benchmarks); the
    default is the best this CPU runs."""
    kernel = load_kernel()
    if (kernel is not None and x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == weight.in_features
            and x.is_contiguous()):  # the engine's case, with as little Python as possible: a GEMV is microseconds
        if weight.scales is not None:
            return kernel.int8_linear(x, weight.data, weight.scales)
        return kernel.gguf_linear(x, weight.data, weight.format.code, isa)
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"quantized_linear takes float32 or bfloat16 CPU activations, got {x.dtype} on {x.device}")
    if x.dim() == 0 or x.shape[-1] != weight.in_features:
        raise ValueError(f"x of shape {tuple(x.shape)} does not end in the weight's {weight.in_features} inputs")
    x2 = x.reshape(-1, weight.in_features).float().contiguous()  # [tokens, in_features]
    if kernel is None:
        y = quantized_linear_torch(x2, weight)
    elif weight.format is QuantFormat.INT8:
        y = kernel.int8_linear(x2, weight.data, weight.scales)
    else:
        y = kernel.gguf_linear(x2, weight.data, weight.format.code, isa)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def available_isas() -> list[int]:
    """The GGUF dot-product ISAs this CPU runs (empty without the C++ module)."""
    kernel = load_kernel()
    return [] if kernel is None else [isa for isa in ISA_NAMES if kernel.dot_isa(isa)]
