"""y = x @ W.T for a quantized W on a GPU (--quantization on cuda): which kernel runs which format.

    Q4_0, Q4_1, Q8_0   triton/gguf_linear.py     the GGUF blocks as stored, dequantized inside the GEMM
    INT8               triton/int8_linear.py     int8 per output channel, weight-only
    FP8                fp8_linear.py             e4m3 weights and per-token e4m3 activations, torch._scaled_mm
    INT8, FP8, one row  triton/weight_only_gemv.py   decode at batch 1: W streamed, no tensor-core padding
                                                     (fp8 weight-only there: x is not quantized)

The CPU's counterpart is cpu_quantized_linear.quantized_linear; engine/model/linear.py picks by where the weight
is. Nothing here syncs with the host, so a decode step's CUDA graph holds these launches.
"""

from __future__ import annotations

import torch

from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight


def cuda_quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [..., in_features] (bfloat16, float16 or float32, on the weight's GPU) -> [..., out_features] in x's
    dtype."""
    if x.device != weight.data.device:
        raise ValueError(f"activations on {x.device}, the {weight.format.label} weight on {weight.data.device}")
    if x.dim() == 0 or x.shape[-1] != weight.in_features:
        raise ValueError(f"x of shape {tuple(x.shape)} does not end in the weight's {weight.in_features} inputs")
    x2 = x.reshape(-1, weight.in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    from engine.kernels.triton import weight_only_gemv as gemv

    if gemv.takes(x2, weight):
        y = gemv.weight_only_gemv(x2, weight)
    elif weight.format is QuantFormat.FP8:
        from engine.kernels.fp8_linear import fp8_linear

        y = fp8_linear(x2, weight)
    elif weight.format is QuantFormat.INT8:
        from engine.kernels.triton.int8_linear import int8_linear

        y = int8_linear(x2, weight)
    else:
        from engine.kernels.triton.gguf_linear import gguf_linear

        y = gguf_linear(x2, weight)
    return y.reshape(*x.shape[:-1], weight.out_features)
