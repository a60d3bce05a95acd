"""Per-token dynamic fp8 quantization of activations (fp8_linear's x̂ and s_x) in one launch: a program per row.

    s[t]     = max(max_k |x[t, k]|, 1e-12) / 448              (IEEE division, div_rn: torch's bits)
    x̂[t, k] = e4m3(x[t, k] / s[t])                            (div_rn, then the hardware's round-to-nearest-even
                                                               conversion, saturating at ±448)

`quantize_fp8_reference` is quantized_weight.quantize_activations_fp8, the torch expression: six
launches (abs, amax, clamp, divide, divide, cast) where this is one, which is what a decode step's CUDA graph of
~65 fp8 GEMMs notices. The row is read twice (its max, then its values), the second time from cache.

Triton 3.6's interpreter converts float32 to float8e4nv with a carry bug (a value that rounds up to the next
power of two comes out at the power below), so the interpreter tests use values that need no rounding; the
`gpu` test compares random rows bit for bit with the torch expression.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quantized_weight import quantize_activations_fp8

FP8_MAX = 448.0
MAX_BLOCK = 4096


@triton.jit
def _fp8_quantize_kernel(
    x_ptr,  # [T, K], rows contiguous
    q_ptr,  # float8_e4m3fn [T, K], contiguous
    scale_ptr,  # float32 [T] (the caller's [T, 1])
    K,
    stride_x,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_ptr + row * K + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def launch_shape(in_features: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of `in_features` values."""
    block = min(MAX_BLOCK, triton.next_power_of_2(in_features))
    return block, 8 if block >= 2048 else 4


def quantize_fp8(x: torch.Tensor, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (float32, bfloat16 or float16, rows contiguous) -> (x̂ float8_e4m3fn [T, K], s float32 [T, 1]).
    `block` overrides the chunk a program reads at a time (tests)."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x: [T, K] with contiguous rows, got {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {x.dtype}"
    num_tokens, in_features = x.shape
    q = torch.empty(num_tokens, in_features, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return q, scale
    chosen, num_warps = launch_shape(in_features)
    _fp8_quantize_kernel[(num_tokens,)](x, q, scale, in_features, x.stride(0), BLOCK=block or chosen,
                                        num_warps=num_warps)
    return q, scale


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_activations_fp8(x)
