"""triton/weight_only_gemv.py: decode's few rows against an int8 or fp8 weight, under the interpreter here and
compiled on a GPU, against x @ (float(q) · scale).T in float32 (at 1-4 rows: the kernel takes any); and the
dispatch that sends it one row.

Bounds: float32 activations and output, only the accumulation order differs: each side's float32 sum of K products
is within K · 2^-24 · (|x| @ |Ŵ|ᵀ) of the exact one (the standard worst case, whatever the SIMD width or the
reduction tree), so the two within K · 2^-23 of each other; bfloat16 output adds its rounding: one ulp, 2^-7 of
|y| (Triton's interpreter truncates to bfloat16).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import cuda_quantized_linear as dispatch  # noqa: E402
from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight  # noqa: E402
from engine.kernels.triton import weight_only_gemv as gemv  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")

FORMATS = [QuantFormat.INT8, QuantFormat.FP8]


def _weight(fmt: QuantFormat, rows: int, cols: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-2, 1, (rows, 1), generator=g)
    w[1] = 0.0  # an all-zero row: scale 1, zeros out
    return QuantizedWeight.quantize_int8(w) if fmt is QuantFormat.INT8 else QuantizedWeight.quantize_fp8(w)


def _check(x: torch.Tensor, weight: QuantizedWeight) -> None:
    y = gemv.weight_only_gemv(x, weight)
    assert y.shape == (x.shape[0], weight.out_features) and y.dtype == x.dtype
    want = gemv.weight_only_gemv_reference(x, weight).cpu()
    dequantized = (weight.data.float() * weight.scales[:, None]).cpu()
    magnitude = x.float().abs().cpu() @ dequantized.abs().T
    accumulation = x.shape[1] * 2.0**-23 * magnitude  # both sums' worst-case rounding (module docstring)
    bound = accumulation + 1e-30 + (2.0**-7 * want.abs() if x.dtype != torch.float32 else 0.0)
    err = (y.cpu().float() - want).abs()
    assert bool((err <= bound).all()), f"max err {err.max().item():.3g}"
    assert bool((y[:, 1] == 0).all())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_gemv_is_the_dequantized_product(device, fmt: QuantFormat, dtype: torch.dtype, rows: int) -> None:
    # 37 outputs (not a multiple of BLOCK_N) and 600 inputs (a full BLOCK_K run and a masked one)
    weight = _weight(fmt, 37, 600, seed=rows).to(device)
    x = (torch.randn(rows, 600, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype).to(device)
    _check(x, weight)


def test_gemv_takes_rows_with_a_stride(device) -> None:
    weight = _weight(QuantFormat.INT8, 16, 64, seed=7).to(device)
    wide = torch.randn(2, 100, generator=torch.Generator().manual_seed(7)).to(device)
    _check(wide[:, :64], weight)  # rows 100 apart


@pytest.mark.parametrize("fmt", [QuantFormat.INT8, QuantFormat.FP8, QuantFormat.Q4_1], ids=lambda f: f.label)
def test_dispatch_sends_one_row_of_int8_and_fp8_to_the_gemv(device, fmt: QuantFormat,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.engine.kernels.quantized_cases import gguf_weight

    weight = (gguf_weight(fmt, 32, 64, seed=0) if fmt.is_gguf else _weight(fmt, 32, 64, seed=0)).to(device)
    calls: list[int] = []
    original = gemv.weight_only_gemv
    monkeypatch.setattr(gemv, "weight_only_gemv", lambda x, w: calls.append(x.shape[0]) or original(x, w))
    for rows in (1, 2, 4, 16):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(device)
        assert dispatch.cuda_quantized_linear(x, weight).shape == (rows, 32)
    assert calls == ([] if fmt.is_gguf else [1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
@pytest.mark.parametrize("shape", [(2048, 2048), (16384, 2048), (2048, 8192)], ids=str)
def test_gemv_at_llama_1b_shapes_gpu(fmt: QuantFormat, shape: tuple[int, int]) -> None:
    weight = _weight(fmt, *shape, seed=0).to("cuda")
    for rows in (1, 4):
        _check(torch.randn(rows, shape[1], device="cuda", dtype=torch.bfloat16), weight)
