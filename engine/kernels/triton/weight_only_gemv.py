"""y = x @ W.T for one row of x (decode at batch 1) and an int8 or fp8 (e4m3) W with one scale per output channel:
weight-only, the stored bytes converted to float32 in registers, x as it is. (The kernel takes any number of rows,
reading W once per row; the dispatch sends it one.)

    grid (cdiv(N, BLOCK_N), M)                       a program: BLOCK_N outputs of one row of x
    acc[n, :] += float(q[n, k:k+BLOCK_K]) · x[m, k:k+BLOCK_K]     elementwise, float32
    y[m, n]   = Σ acc[n, :] · scale[n]

At one row a GEMM is a read of W and nothing else: tl.dot pads the rows to 16 and a [16, 16] tile's program walks
K alone (triton/int8_linear.py at batch 1 is slower than cuBLAS on the bfloat16 weights twice the size), and
fp8_linear adds a quantization launch per GEMM for one row. Here every program streams BLOCK_N rows of W in
BLOCK_K-byte runs with no tensor-core padding. Measured on an H200 (bench/quantized_gemv.py, in CUDA graphs, the
Llama-1B layers of one step): at one row fp8 0.49 ms and int8 0.54 ms against bf16 cuBLAS 0.70 ms, scaled_mm 1.01
ms, int8 tl.dot 0.88 ms; at four rows 1.21 / 1.37 ms, behind all three, since each row reads W again.

int8: the same product as triton/int8_linear.py's (exact values, float32 accumulation). fp8: weight-only, x not
quantized: the error is W's e4m3 rounding alone (≤ 2^-4 relative a factor), half fp8_linear's bound, so a row's
result depends on the batch's size the way any GEMM's accumulation order does. e4m3 → float32 needs sm_89+, as
fp8 does anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight, linear_output

MAX_ROWS = 1  # above this the tensor-core kernels (int8_linear, torch._scaled_mm) win: they read W once
FORMATS = (QuantFormat.INT8, QuantFormat.FP8)
BLOCK_N, BLOCK_K, NUM_WARPS = 4, 1024, 4  # the best at one row on an H200 (bench/quantized_gemv.py)


@triton.jit
def _weight_only_gemv_kernel(
    x_ptr,  # [M, K], rows contiguous
    w_ptr,  # int8 or float8_e4m3fn [N, K], contiguous
    scale_ptr,  # float32 [N]
    y_ptr,  # [M, N], x's dtype
    N,
    K,
    stride_xm,
    stride_ym,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    mask_n = rn < N
    w_rows = w_ptr + rn[:, None] * K  # [BLOCK_N, 1]
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = (k + rk) < K
        x = tl.load(x_row + k + rk, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
        q = tl.load(w_rows + k + rk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK]
        acc += q.to(tl.float32) * x[None, :]
    scale = tl.load(scale_ptr + rn, mask=mask_n, other=0.0)
    y = tl.sum(acc, axis=1) * scale
    tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def takes(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether this kernel is the one for x [M, K] and `weight` (a few rows, an int8 or fp8 weight)."""
    return weight.format in FORMATS and 0 < x.shape[0] <= MAX_ROWS


def weight_only_gemv(x: torch.Tensor, weight: QuantizedWeight, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                     num_warps: int = NUM_WARPS) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16, rows contiguous; any M, W read once a row) @ W.T -> [M, N] in x's
    dtype, W an INT8 or FP8 `QuantizedWeight` on x's device. The tile's sizes are overridable (bench/quantized_gemv.py)."""
    assert weight.format in FORMATS and weight.scales is not None, f"got {weight.format.label}"
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == weight.in_features, (
        f"x of shape {tuple(x.shape)}: want [M, {weight.in_features}] with contiguous rows")
    y = linear_output(x, weight)
    num_tokens, out_features = y.shape
    if num_tokens == 0:
        return y
    grid = (triton.cdiv(out_features, block_n), num_tokens)
    _weight_only_gemv_kernel[grid](x, weight.data, weight.scales, y, out_features, weight.in_features, x.stride(0),
                                   y.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y


def weight_only_gemv_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ (float(q) · scale).T in float32: [M, K] -> [M, N] float32."""
    assert weight.scales is not None
    return (x.float() @ weight.data.float().T) * weight.scales
