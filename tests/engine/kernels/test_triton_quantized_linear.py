"""The Triton quantized GEMMs (GGUF blocks, int8 per channel) against their torch references, in the interpreter on
CPU (on the GPU where there is one), at small shapes: several tiles in M and N, a ragged last tile, 3-4 blocks.
float32 and float16 there: Triton's interpreter multiplies bfloat16 bit patterns as integers in tl.dot, so
bfloat16 (the dtype a GPU serves in) runs in the `gpu` tests, at Llama-3.2-1B's sizes.

Bounds, first-order worst cases (a wrong nibble order, scale, minimum or sign is an error the size of y itself):

    float32 x:  |Δ| ≤ (K + 64) · 2^-24 · (|x| @ |Ŵ|ᵀ)            summation order only (the codes are exact)
    bf16/fp16:  the same on the float32 result, plus the one rounding of y to x's dtype (½ ulp: 2^-8 / 2^-11 |y|)
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight  # noqa: E402
from engine.kernels.triton.gguf_linear import gguf_linear, gguf_linear_reference  # noqa: E402
from engine.kernels.triton.int8_linear import int8_linear, int8_linear_reference  # noqa: E402
from tests.engine.kernels.quantized_cases import GGUF_FORMATS, activations, assert_within, gguf_weight  # noqa: E402

@pytest.mark.parametrize("fmt", GGUF_FORMATS, ids=lambda f: f.label)
@pytest.mark.parametrize("tokens", [1, 5, 20])  # decode's tile; prefill's, ragged
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gguf_matches_reference(device, fmt: QuantFormat, tokens: int, dtype: torch.dtype) -> None:
    weight = gguf_weight(fmt, 40, 96, seed=fmt.code)
    x = activations(tokens, 96, seed=tokens, dtype=dtype, device=device)
    got = gguf_linear(x, weight.to(device))
    assert got.shape == (tokens, 40) and got.dtype == dtype and got.device == x.device
    assert_within(got, x, weight.dequantize())
    if dtype is torch.float32:  # the reference itself is x @ dequantize(W).T
        torch.testing.assert_close(gguf_linear_reference(x, weight.to(device)).cpu(),
                                   x.cpu() @ weight.dequantize().T)


@pytest.mark.parametrize("fmt", GGUF_FORMATS, ids=lambda f: f.label)
def test_gguf_shards_and_fp16(device, fmt: QuantFormat) -> None:
    """A column-parallel shard (a row view at an offset) and a row-parallel one (whole blocks, a copy) compute
    their part of the whole product; float16 activations too."""
    weight = gguf_weight(fmt, 48, 128, seed=7)
    x = activations(3, 128, seed=3, dtype=torch.float16, device=device)
    rows = weight.rows(16, 48).to(device)
    assert_within(gguf_linear(x, rows), x, weight.dequantize()[16:48])
    cols = weight.columns(32, 96).to(device)
    x_cols = x[:, 32:96].contiguous()
    assert_within(gguf_linear(x_cols, cols), x_cols, weight.dequantize()[:, 32:96])


@pytest.mark.parametrize("tokens", [1, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_int8_matches_reference(device, tokens: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(tokens)
    dense = torch.randn(40, 200, generator=g) * 10.0 ** torch.randint(-2, 1, (40, 1), generator=g)
    dense[3] = 0.0
    weight = QuantizedWeight.quantize_int8(dense)  # K = 200: a ragged last K tile
    x = activations(tokens, 200, seed=tokens, dtype=dtype, device=device)
    got = int8_linear(x, weight.to(device))
    assert got.shape == (tokens, 40) and got.dtype == dtype
    assert_within(got, x, weight.dequantize())
    assert_within(int8_linear_reference(x, weight.to(device)), x, weight.dequantize())


def test_int8_row_shard(device) -> None:
    weight = QuantizedWeight.quantize_int8(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)))
    x = activations(2, 64, seed=2, dtype=torch.float32, device=device)
    assert_within(int8_linear(x, weight.rows(8, 40).to(device)), x, weight.dequantize()[8:40])


def test_refuses_mismatches(device) -> None:
    weight = gguf_weight(QuantFormat.Q8_0, 8, 64, seed=0).to(device)
    with pytest.raises(AssertionError, match="inputs"):
        gguf_linear(torch.zeros(1, 32, device=device), weight)
    with pytest.raises(AssertionError, match="Q4_0/Q4_1/Q8_0"):
        gguf_linear(torch.zeros(1, 64, device=device), QuantizedWeight.quantize_int8(torch.ones(8, 64)).to(device))


@functools.cache
def _full_size_weight(fmt: QuantFormat, out_features: int, in_features: int) -> QuantizedWeight:
    if fmt is QuantFormat.INT8:
        dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
        return QuantizedWeight.quantize_int8(dense)
    return gguf_weight(fmt, out_features, in_features, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [*GGUF_FORMATS, QuantFormat.INT8], ids=lambda f: f.label)
@pytest.mark.parametrize("tokens", [1, 256])
@pytest.mark.parametrize("shape", [(16384, 2048), (2048, 8192)])  # Llama-3.2-1B's gate_up and down
def test_full_size_bfloat16_gpu(fmt: QuantFormat, tokens: int, shape: tuple[int, int]) -> None:
    weight = _full_size_weight(fmt, *shape)
    run = int8_linear if fmt is QuantFormat.INT8 else gguf_linear
    x = activations(tokens, shape[1], seed=1, dtype=torch.bfloat16, device="cuda")
    assert_within(run(x, weight.to("cuda")), x, weight.dequantize())
