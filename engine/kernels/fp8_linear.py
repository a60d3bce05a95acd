"""y = x @ W.T for an fp8 W (--quantization fp8, cuda): e4m3 weights with one scale per output channel
(QuantizedWeight.quantize_fp8, at load), activations quantized to e4m3 per token at each call, one
`torch._scaled_mm` (cuBLASLt / CUTLASS fp8 tensor cores: sm_89+, Ada and Hopper).

    activations   s_x[t] = max(max_k |x[t, k]|, 1e-12) / 448       x̂[t, k] = e4m3(x[t, k] / s_x[t])
    weights       s_w[o] = max_k |W[o, k]| / 448                    Ŵ[o, k] = e4m3(W[o, k] / s_w[o])
    product       y[t, o] = s_x[t] · s_w[o] · Σ_k x̂[t, k] · Ŵ[o, k]      (float32 accumulation, bf16 out)

Dynamic per-token scales need no calibration and no host sync (the amax is a device reduction), so the call
runs inside a CUDA graph. On a GPU the activations are quantized by one Triton launch (triton/fp8_quantize.py,
the same bits as quantized_weight.quantize_activations_fp8, the torch expression, which the CPU runs): two launches a
GEMM, against one unquantized. e4m3 keeps 3 mantissa bits: each factor carries a relative rounding error of at most
2^-4, so |y - x @ W.T| ≤ (2^-4 + 2^-4 + 2^-8) · (|x| @ |W|ᵀ) + bf16's rounding of y (first order); subnormal
e4m3 values (below 2^-6 of the row's scale) lose more, in absolute terms at most 2^-10 · s each.

One row (decode at batch 1) does not come here: cuda_quantized_linear sends it to triton/weight_only_gemv.py, the
e4m3 weights times the unquantized row (no quantization launch; on an H200 a Llama-1B step's GEMMs take 0.49 ms
that way against 1.01 ms here).

`fp8_linear_emulated` computes the same product in float32 from the same e4m3 values (what _scaled_mm computes,
up to its accumulation order): the tests' reference, and the path for shapes _scaled_mm does not take
(in or out features not a multiple of 16: a tiny test model's vocabulary).
"""

from __future__ import annotations

import torch

from engine.kernels.quantized_weight import FP8_MAX, QuantFormat, QuantizedWeight, quantize_activations_fp8

__all__ = ["FP8_MAX", "check_fp8_device", "fp8_linear", "fp8_linear_emulated", "quantize_activations_fp8",
           "scaled_mm_takes"]

MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (sm_89), Hopper (sm_90) and later
_ALIGN = 16  # _scaled_mm's K and N granularity


def check_fp8_device(device: torch.device) -> None:
    """ValueError unless `device` is a GPU with fp8 tensor cores (what torch._scaled_mm needs)."""
    if device.type != "cuda":
        raise ValueError("quantization fp8 needs cuda (e4m3 weights, torch._scaled_mm); on cpu use int8 or gguf")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise ValueError(f"quantization fp8 needs a GPU of compute capability 8.9 or later (fp8 tensor cores for "
                         f"torch._scaled_mm); {torch.cuda.get_device_name(device)} is {major}.{minor}: use int8 or "
                         "gguf, or none")


def scaled_mm_takes(weight: QuantizedWeight) -> bool:
    """Whether torch._scaled_mm takes this weight's shape (in and out features multiples of 16)."""
    return weight.in_features % _ALIGN == 0 and weight.out_features % _ALIGN == 0


def fp8_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [T, K] (rows contiguous; any float dtype) @ W.T -> [T, N] in x's dtype, W an FP8 `QuantizedWeight` on
    x's device."""
    assert weight.format is QuantFormat.FP8 and weight.scales is not None, f"got {weight.format.label}"
    assert x.dim() == 2 and x.shape[1] == weight.in_features, (
        f"x of shape {tuple(x.shape)} does not have the weight's {weight.in_features} inputs")
    if not scaled_mm_takes(weight):
        return fp8_linear_emulated(x, weight).to(x.dtype)
    if x.is_cuda:
        from engine.kernels.triton.fp8_quantize import quantize_fp8

        x_q, x_scale = quantize_fp8(x if x.stride(1) == 1 else x.contiguous())
    else:
        x_q, x_scale = quantize_activations_fp8(x)
    # [T, K] @ [K, N]: W's rows are contiguous, so W.T is the column-major operand _scaled_mm wants.
    y = torch._scaled_mm(x_q, weight.data.t(), scale_a=x_scale, scale_b=weight.scales.view(1, -1),
                         out_dtype=torch.bfloat16)  # row-wise scales: bf16 output only
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def fp8_linear_emulated(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The same product in float32: (s_x · x̂) @ (s_w · Ŵ).T from the e4m3 values fp8_linear uses. [T, K] ->
    [T, N] float32."""
    assert weight.scales is not None
    x_q, x_scale = quantize_activations_fp8(x)
    return (x_q.float() * x_scale) @ (weight.data.float() * weight.scales[:, None]).T
