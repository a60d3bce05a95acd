"""y = x @ W.T for an int8 weight-only W (symmetric per output channel) on a GPU: the int8 values read as stored,
converted to x's dtype inside the GEMM, each output column scaled once at the end.

    grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))      one [BLOCK_M, BLOCK_N] tile of y per program
    acc[m, n] = Σ_k x[m, k] · q[n, k]              tl.dot over BLOCK_K at a time, float32 accumulation
    y[m, n]   = acc[m, n] · scale[n]

An int8 value (|q| <= 127) is exact in bfloat16, float16 and float32, so the only rounding is the dot's float32
accumulation and the one scale multiply: quantized_weight.quantized_linear_torch's INT8 contract,
(x @ q.T) · scale, which `int8_linear_reference` computes in float32 and the tests hold the kernel to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight, linear_output


@triton.jit
def _int8_linear_kernel(
    x_ptr,  # [M, K], rows contiguous
    w_ptr,  # int8 [N, K], contiguous
    scale_ptr,  # float32 [N]
    y_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + rn[:, None] * K  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = (k + rk) < K
        x = tl.load(x_rows + k + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        q = tl.load(w_rows + k + rk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)  # [BN, BK]
        w = q.to(tl.float32).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    scale = tl.load(scale_ptr + rn, mask=mask_n, other=0.0)  # [BLOCK_N]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, (acc * scale[None, :]).to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch_shape(num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): narrow N tiles for decode's few rows, square ones for prefill."""
    if num_tokens <= 16:  # decode: 16 rows a program (Llama-1B's 2048 outputs: 128 programs), 4 KiB a load
        return 16, 16, 256, 4
    if num_tokens <= 64:
        return 64, 64, 64, 4
    return 128, 64, 64, 8


def int8_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16, rows contiguous) @ W.T -> [M, N] in x's dtype, W an INT8
    `QuantizedWeight` on x's device."""
    assert weight.format is QuantFormat.INT8 and weight.scales is not None, f"got {weight.format.label}"
    y = linear_output(x, weight)
    num_tokens, out_features = y.shape
    if num_tokens == 0:
        return y
    block_m, block_n, block_k, num_warps = launch_shape(num_tokens)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _int8_linear_kernel[grid](
        x, weight.data, weight.scales, y, num_tokens, out_features, weight.in_features, x.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=num_warps,
    )
    return y


def int8_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """(x @ q.T) · scale in float32, cast to x's dtype: [M, K] -> [M, N]."""
    assert weight.scales is not None
    return ((x.float() @ weight.data.float().T) * weight.scales).to(x.dtype)
