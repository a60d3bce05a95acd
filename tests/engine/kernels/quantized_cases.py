"""Quantized weights and activations for the Triton quantized-GEMM tests, and the bound they are held to:

    float32 x:  |Δ| ≤ (K + 64) · 2^-24 · (|x| @ |Ŵ|ᵀ)            summation order only (the codes are exact)
    bf16/fp16:  the same on the float32 result, plus the one rounding of y to x's dtype (½ ulp: 2^-8 / 2^-11 |y|)
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import quantize as gguf_quantize

from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight

EPS = 2.0**-24
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
GGUF_FORMATS = [QuantFormat.Q4_0, QuantFormat.Q4_1, QuantFormat.Q8_0]


def gguf_weight(fmt: QuantFormat, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    """gguf's own quantizer on rows of mixed magnitudes, one row all zeros, an offset for Q4_1's minimum."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    w *= np.float32(10.0) ** rng.integers(-2, 1, (out_features, 1))
    w[min(3, out_features - 1)] = 0.0
    if fmt is QuantFormat.Q4_1:
        w += np.float32(0.05)
    assert fmt.ggml_type is not None
    return QuantizedWeight.from_gguf(gguf_quantize(w, fmt.ggml_type), fmt.ggml_type, (out_features, in_features))


def activations(tokens: int, in_features: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(seed)) * 2
    return x.to(dtype).to(device)


def assert_within(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """`got` against x @ dense.T in float32 within the module docstring's bound."""
    x32, w32 = x.float().cpu(), dense.float().cpu()
    want = x32 @ w32.T
    k = x.shape[1]
    bound = (k + 64) * EPS * (x32.abs() @ w32.abs().T) + ROUNDING[x.dtype] * want.abs() + 1e-30
    err = (got.float().cpu() - want).abs()
    worst = int((err / bound).argmax())
    assert bool((err <= bound).all()), (f"{int((err > bound).sum())} of {err.numel()} outputs off; worst: got "
                                        f"{got.float().flatten()[worst]}, want {want.flatten()[worst]}")
