"""y = x @ W.T for a GGUF-quantized W (Q4_0, Q4_1, Q8_0) on a GPU: the file's blocks read as stored, dequantized
inside the GEMM (engine/kernels/quantized_weight.py describes the blocks).

    grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))      one [BLOCK_M, BLOCK_N] tile of y per program
    per block b of 32 inputs (the row's blocks in order):
        codes q[n, i]   Q4_0: nibble - 8    Q4_1: nibble    Q8_0: the int8       (exact in bf16/fp16/fp32)
        acc[m, n] += d[n, b] · Σ_i x[m, 32b + i] · q[n, i]                       one tl.dot, K = 32
                   (+ m[n, b] · Σ_i x[m, 32b + i]                                Q4_1's minimum)

    block bytes (offset from the block's start; every field 2-byte aligned, so the scales are read through a
    float16 view of the same bytes):
        Q4_0  d:f16 @0, nibbles @2..17         byte j of the nibbles: value j (low), value j + 16 (high)
        Q4_1  d:f16 @0, m:f16 @2, nibbles @4..19
        Q8_0  d:f16 @0, q:int8 @2..33

The codes times the activations in x's dtype, accumulated in float32 (tl.dot; `ieee` for float32 x), the scale
applied per block in float32: that is x @ dequantize(W).T up to float32 rounding, with no rounding of the weights
at all (a code is an integer of at most 8 bits). `gguf_linear_reference` is x @ dequantize(W).T in float32, what
the tests hold the kernel to (quantized_weight.quantized_linear_reference on the device).

A decode step's GEMV (M = 1) runs the same kernel with BLOCK_M = 16 (tl.dot's least) and narrower N tiles, so
that the GPU has enough programs: it is bound by reading W, not by the wasted MMA rows. Each loop iteration takes
UNROLL blocks, so that their loads are in flight together (one block of 16 rows is only ~300-550 bytes). The
launch shapes are chosen without a GPU to measure on: the first GPU session's figures may move them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight, linear_output

# tl.constexpr codes of the formats (QuantFormat.code, the C++ side's numbers)
FMT_Q4_0, FMT_Q4_1, FMT_Q8_0 = QuantFormat.Q4_0.code, QuantFormat.Q4_1.code, QuantFormat.Q8_0.code


@triton.jit
def _gguf_linear_kernel(
    x_ptr,  # [M, K], rows contiguous
    w_ptr,  # uint8 [N, row_bytes]: the blocks as stored
    w16_ptr,  # the same bytes as float16 [N, row_bytes / 2]: the scales (and Q4_1 minimums)
    y_ptr,  # [M, N], x's dtype
    M,
    N,
    num_blocks,  # K / 32
    stride_xm,
    stride_ym,
    row_bytes,
    FMT: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,  # GGUF blocks an iteration: their loads in flight together
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = rm < M
    mask_n = rn < N
    j = tl.arange(0, 32)
    if FMT == 2:  # Q8_0: value j is byte 2 + j
        code_offset = 2 + j
    elif FMT == 1:  # Q4_1: nibbles from byte 4
        code_offset = 4 + (j % 16)
    else:  # Q4_0: nibbles from byte 2
        code_offset = 2 + (j % 16)
    high = j >= 16  # [32]: a nibble format's value j >= 16 is its byte's high nibble
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = rn * row_bytes  # [BLOCK_N] byte offset of each row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, num_blocks, UNROLL):
        for i in tl.static_range(UNROLL):
            b = b0 + i
            # the last iteration may run past the row's blocks (vectors, all alike: the interpreter takes no
            # scalar in a mask)
            in_row = (j * 0 + b) < num_blocks  # [32]
            w_mask = mask_n & ((rn * 0 + b) < num_blocks)  # [BLOCK_N]
            start = w_rows + b * BLOCK_BYTES  # [BLOCK_N] byte offset of block b of each row
            d = tl.load(w16_ptr + start // 2, mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
            raw = tl.load(w_ptr + start[:, None] + code_offset[None, :], mask=w_mask[:, None] & in_row[None, :],
                          other=0)  # [BLOCK_N, 32]
            if FMT == 2:
                codes = raw.to(tl.int8, bitcast=True).to(tl.float32)
            else:
                nibble = tl.where(high[None, :], raw >> 4, raw & 0xF).to(tl.float32)
                if FMT == 0:
                    codes = nibble - 8.0
                else:
                    codes = nibble
            x = tl.load(x_rows + b * 32 + j[None, :], mask=mask_m[:, None] & in_row[None, :], other=0.0)  # [BM, 32]
            w = codes.to(x.dtype)
            if IEEE:
                part = tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w))
            acc += part * d[None, :]
            if FMT == 1:
                minimum = tl.load(w16_ptr + start // 2 + 1, mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
                x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
                acc += x_sum[:, None] * minimum[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


UNROLL = 4  # GGUF blocks (128 inputs) an iteration; a row's last iteration masks what runs past it


def launch_shape(num_tokens: int, fp32: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for `num_tokens` rows of x: narrow N tiles for decode's few rows (more
    programs over the weight: Llama-1B's 2048 outputs are 128 programs for 132 SMs), square ones for prefill.
    float32 tiles stop at 64 rows (128 would take 139 KB of shared memory, over sm_89's 100 KB)."""
    if num_tokens <= 16:
        return 16, 16, 4
    if num_tokens <= 64 or fp32:
        return 64, 64, 4
    return 128, 64, 8


def gguf_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16, rows contiguous) @ W.T -> [M, N] in x's dtype, W a GGUF-format
    `QuantizedWeight` on x's device."""
    fmt = weight.format
    assert fmt.is_gguf, f"gguf_linear takes Q4_0/Q4_1/Q8_0 weights, got {fmt.label}"
    y = linear_output(x, weight)
    num_tokens, out_features = y.shape
    if num_tokens == 0:
        return y
    block_m, block_n, num_warps = launch_shape(num_tokens, fp32=x.dtype == torch.float32)
    data = weight.data  # [N, row_bytes]; row_bytes = K / 32 * block_bytes, even for every format here
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _gguf_linear_kernel[grid](
        x, data, data.view(torch.float16), y, num_tokens, out_features, weight.in_features // 32, x.stride(0),
        y.stride(0), data.shape[1], FMT=fmt.code, BLOCK_BYTES=fmt.block_bytes, BLOCK_M=block_m, BLOCK_N=block_n,
        UNROLL=UNROLL, IEEE=x.dtype == torch.float32, num_warps=num_warps,
    )
    return y


def gguf_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ dequantize(W).T in float32 (gguf_quants' bit-exact decoders), cast to x's dtype: [M, K] -> [M, N]."""
    dense = weight.dequantize().to(x.device)
    return (x.float() @ dense.T).to(x.dtype)
