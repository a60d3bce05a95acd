"""The quantized CPU kernels against their torch expressions (engine/kernels/quantized_weight.py).

Two bounds, both first-order worst cases, so a correct kernel cannot fail them and a wrong block layout, scale or
sign (an error the size of the output itself) cannot pass:

    kernel vs quantized_linear_torch (the same arithmetic, another summation order):
        |Δ| ≤ (K + K/32 + 16) · 2^-24 · (|x̂| @ |Ŵ|ᵀ)        x̂ = q8(x) (GGUF) or x (INT8), Ŵ = dequantize(W)
    kernel vs quantized_linear_reference (float activations, x @ Ŵᵀ), GGUF only: the Q8 rounding of x on top,
        at most half a step (d_x / 2) per value:  |Δ| ≤ (½ d_x + 4 · 2^-24 |x|) @ |Ŵ|ᵀ + the bound above
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from engine.kernels import cpu_quantized_linear
from engine.kernels.cpu_quantized_linear import ISA_NAMES, available_isas, load_kernel, quantized_linear
from engine.kernels.quantized_weight import (
    QuantFormat,
    QuantizedWeight,
    dequantize_activations_q8,
    quantize_activations_q8,
    quantized_linear_reference,
    quantized_linear_torch,
)

EPS = 2.0**-24
GGUF_FORMATS = [QuantFormat.Q4_0, QuantFormat.Q4_1, QuantFormat.Q8_0]


@pytest.fixture(scope="module")
def kernel():
    module = load_kernel()
    assert module is not None, "the C++ kernels must build on the CI machine (gcc and ninja are dependencies)"
    return module


def gguf_weight(fmt: QuantFormat, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    """gguf's own quantizer on a float matrix whose rows span magnitudes, one row all zeros."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    w *= np.float32(10.0) ** rng.integers(-3, 1, (out_features, 1))
    w[min(3, out_features - 1)] = 0.0
    if fmt is QuantFormat.Q4_1:
        w += np.float32(0.01)  # an offset for the minimum to carry
    assert fmt.ggml_type is not None
    return QuantizedWeight.from_gguf(gguf_quantize(w, fmt.ggml_type), fmt.ggml_type, (out_features, in_features))


def activations(tokens: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g) * 3
    x[0, :32] = 0.0  # a zero block: d = 0
    return x


def float_bound(x_abs: torch.Tensor, w_abs: torch.Tensor) -> torch.Tensor:
    in_features = x_abs.shape[1]
    return (in_features + in_features // 32 + 16) * EPS * (x_abs @ w_abs.T)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    excess = (got - want).abs() - bound
    worst = int(excess.argmax())
    assert float(excess.max()) <= 0, (f"|Δ| {float((got - want).abs().flatten()[worst]):.3g} > bound "
                                      f"{float(bound.flatten()[worst]):.3g} at {worst}")


def test_activation_q8_is_the_same_bits_in_cpp_and_torch(kernel) -> None:
    x = activations(7, 256, seed=1)
    x[1, 32:64] = torch.arange(32) - 15.5  # ties: x / d lands on halves (rounded to even by both)
    q, d = kernel.quantize_q8(x)
    q_torch, d_torch = quantize_activations_q8(x)
    assert torch.equal(q, q_torch) and torch.equal(d, d_torch)
    assert int(q.abs().max()) == 127 and not bool(q[0, :32].any())
    # What the reference bound leans on: every value within half a step of its block.
    err = (dequantize_activations_q8(q, d) - x).abs().view(7, -1, 32)
    assert bool((err <= d[..., None] / 2 + 4 * EPS * x.abs().view(7, -1, 32)).all())


@pytest.mark.parametrize("fmt", GGUF_FORMATS, ids=lambda f: f.label)
# 27: 3 tiles of 8 (2 + 1) and 3 tokens (2 + 1); 75: 9 tiles (groups of 4 + 4 + 1, or 2 a group past 32 blocks)
@pytest.mark.parametrize("tokens", [1, 5, 27, 32, 75])
# 1030 x 1088: 34 blocks a row (the lanes path's 2-tile groups), rows in chunks of 16 and a partial one
@pytest.mark.parametrize("shape", [(77, 96), (130, 576), (1030, 1088)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gguf_kernel_matches_torch_on_every_isa(kernel, fmt: QuantFormat, tokens: int, shape) -> None:
    out_features, in_features = shape
    weight = gguf_weight(fmt, out_features, in_features, seed=tokens)
    x = activations(tokens, in_features, seed=out_features)
    w_abs = weight.dequantize().abs()
    x_hat = dequantize_activations_q8(*quantize_activations_q8(x))
    want = quantized_linear_torch(x, weight)
    reference = quantized_linear_reference(x, weight)
    q8_bound = (dequantize_activations_q8(torch.ones_like(x, dtype=torch.int8), quantize_activations_q8(x)[1]) / 2
                + 4 * EPS * x.abs()) @ w_abs.T

    isas = available_isas()
    assert isas and isas[0] == cpu_quantized_linear.ISA_AVX2
    for isa in isas:
        got = quantized_linear(x, weight, isa=isa)
        assert got.shape == (tokens, out_features) and got.dtype == torch.float32, ISA_NAMES[isa]
        assert_within(got, want, float_bound(x_hat.abs(), w_abs))
        assert_within(got, reference, q8_bound + float_bound(x_hat.abs() + x.abs(), w_abs))


# 13: two groups of 6 tokens (4 on AVX2) and leftovers; 75: 12 groups and 3; 67 rows: a 64-row chunk, 3 left over
@pytest.mark.parametrize("tokens", [1, 2, 13, 32, 75])
@pytest.mark.parametrize("in_features", [99, 576])
def test_int8_kernel_matches_torch(kernel, tokens: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(in_features)
    weight = QuantizedWeight.quantize_int8(torch.randn(67, in_features, generator=g))
    x = activations(tokens, in_features, seed=tokens)
    got = quantized_linear(x, weight)
    bound = float_bound(x.abs(), weight.dequantize().abs())
    assert_within(got, quantized_linear_torch(x, weight), bound)
    assert_within(got, quantized_linear_reference(x, weight), bound)


def test_int8_quantization_is_symmetric_per_output_channel() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [254.0, 1.0, -127.0]])
    q = QuantizedWeight.quantize_int8(w)
    assert q.scales.tolist() == pytest.approx([2 / 127, 1.0, 2.0])
    assert q.data.tolist() == [[64, -127, 32], [0, 0, 0], [127, 0, -64]]  # 0.5 rounds to even
    assert bool(((q.dequantize() - w).abs() <= q.scales[:, None] / 2).all())  # within half a step


@pytest.mark.parametrize("fmt", GGUF_FORMATS + [QuantFormat.INT8], ids=lambda f: f.label)
def test_bfloat16_activations_and_leading_dims(kernel, fmt: QuantFormat) -> None:
    weight = (QuantizedWeight.quantize_int8(torch.randn(40, 64)) if fmt is QuantFormat.INT8
              else gguf_weight(fmt, 40, 64, seed=2))
    x = activations(6, 64, seed=3).to(torch.bfloat16).view(2, 3, 64)
    got = quantized_linear(x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 40)
    want = quantized_linear_torch(x.view(6, 64), weight).to(torch.bfloat16).view(2, 3, 40)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)  # both round the same float32 result to bf16


@pytest.mark.parametrize("fmt", GGUF_FORMATS + [QuantFormat.INT8], ids=lambda f: f.label)
def test_fallback_without_the_cpp_module_computes_the_same(kernel, fmt: QuantFormat, monkeypatch) -> None:
    weight = (QuantizedWeight.quantize_int8(torch.randn(50, 128)) if fmt is QuantFormat.INT8
              else gguf_weight(fmt, 50, 128, seed=4))
    x = activations(5, 128, seed=5)
    with_kernel = quantized_linear(x, weight)
    monkeypatch.setattr(cpu_quantized_linear, "load_kernel", lambda: None)
    without = quantized_linear(x, weight)
    assert torch.equal(without, quantized_linear_torch(x, weight))
    x_used = x if fmt is QuantFormat.INT8 else dequantize_activations_q8(*quantize_activations_q8(x))
    assert_within(with_kernel, without, float_bound(x_used.abs(), weight.dequantize().abs()))


@pytest.mark.parametrize("fmt", GGUF_FORMATS + [QuantFormat.INT8], ids=lambda f: f.label)
def test_shards_are_whole_rows_or_whole_blocks(kernel, fmt: QuantFormat) -> None:
    weight = (QuantizedWeight.quantize_int8(torch.randn(48, 192)) if fmt is QuantFormat.INT8
              else gguf_weight(fmt, 48, 192, seed=6))
    x = activations(3, 192, seed=7)
    full = quantized_linear(x, weight)
    assert torch.equal(quantized_linear(x, weight.rows(16, 40)), full[:, 16:40])  # the same rows, the same sums
    left, right = weight.columns(0, 96), weight.columns(96, 192)
    assert left.data.numel() + right.data.numel() == weight.data.numel()
    assert torch.equal(torch.cat([left.dequantize(), right.dequantize()], dim=1), weight.dequantize())
    with pytest.raises(ValueError, match="block boundaries"):
        weight.columns(0, 100 if fmt is not QuantFormat.INT8 else 300)


def test_real_smollm2_blocks(kernel, smollm2_gguf: str) -> None:
    """The model's own Q4_1 FFN down projection and a slice of its Q8_0 embedding (the tied LM head)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(smollm2_gguf).tensors}
    for name, rows in (("blk.0.ffn_down.weight", None), ("token_embd.weight", 300)):
        t = tensors[name]
        in_features = int(t.shape[0])  # GGUF lists the innermost dimension first
        data = t.data if rows is None else t.data[1000 : 1000 + rows]  # [rows, bytes a row]: whole rows
        weight = QuantizedWeight.from_gguf(data, t.tensor_type, (data.shape[0], in_features))
        assert weight.format.ggml_type == t.tensor_type
        x = activations(2, in_features, seed=8) * 0.1
        x_hat = dequantize_activations_q8(*quantize_activations_q8(x))
        assert_within(quantized_linear(x, weight), quantized_linear_torch(x, weight),
                      float_bound(x_hat.abs(), weight.dequantize().abs()))


# -- malformed input: one clear error ------------------------------------------------------------------------------
def test_a_nan_scale_or_minimum_is_refused_naming_the_block() -> None:
    weight = gguf_weight(QuantFormat.Q4_1, 4, 64, seed=9)
    for offset, what in ((0, "scale"), (2, "minimum")):
        data = weight.data.clone()
        data[2, 20 + offset : 22 + offset] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
        with pytest.raises(ValueError, match=f"block 1 of output row 2 has a non-finite {what}"):
            QuantizedWeight(format=QuantFormat.Q4_1, data=data, in_features=64)
    with pytest.raises(ValueError, match="scale of output row 1 is inf"):
        QuantizedWeight(format=QuantFormat.INT8, data=torch.zeros(2, 8, dtype=torch.int8), in_features=8,
                        scales=torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="non-finite"):
        QuantizedWeight.quantize_int8(torch.tensor([[1.0, float("nan")]]))


def test_wrong_shapes_and_types_are_refused(kernel) -> None:
    with pytest.raises(ValueError, match="needs 40 bytes, got 39"):
        QuantizedWeight.from_gguf(np.zeros(39, dtype=np.uint8), T.Q4_1, (2, 32))
    with pytest.raises(ValueError, match="Q6_K"):
        QuantizedWeight.from_gguf(np.zeros(210, dtype=np.uint8), T.Q6_K, (1, 256))
    with pytest.raises(ValueError, match="not a positive multiple of 32"):
        QuantizedWeight(format=QuantFormat.Q8_0, data=torch.zeros(1, 34, dtype=torch.uint8), in_features=33)
    with pytest.raises(ValueError, match="int8 weight needs float32 scales"):
        QuantizedWeight(format=QuantFormat.INT8, data=torch.zeros(2, 8, dtype=torch.int8), in_features=8)
    weight = gguf_weight(QuantFormat.Q8_0, 4, 64, seed=10)
    with pytest.raises(ValueError, match="does not end in the weight's 64 inputs"):
        quantized_linear(torch.zeros(3, 32), weight)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantized_linear(torch.zeros(3, 64, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="64 inputs need 68"):  # the C++ side checks too
        kernel.gguf_linear(torch.zeros(1, 64), torch.zeros(4, 70, dtype=torch.uint8), 2, -1)
