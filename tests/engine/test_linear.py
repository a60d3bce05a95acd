"""engine/model/linear.py: the packed oneDNN GEMM against F.linear, and the fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import Linear, onednn_usable
from kv_transfer.native_build import read_cpu_flags

# The model's shapes (SmolLM2-135M: QKV, O, gate/up, down, a vocab-sized head) and row counts from one-token
# decode to a full prefill step.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 64)]
ROWS = [1, 2, 17, 256, 600]


def _inputs(out_features: int, in_features: int, rows: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=g) * in_features**-0.5).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    return w, b, x


def test_onednn_path_is_live_on_this_cpu() -> None:
    # The torch CPU wheel ships oneDNN: the fast path must be live here, or the benchmarks measure the fallback.
    w = torch.randn(8, 4)
    assert onednn_usable(w)
    lin = Linear(w)
    assert lin.packed is not None and lin.weight is None  # the packed copy replaces the dense one


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_float32_matches_f_linear(shape: tuple[int, int], rows: int, with_bias: bool) -> None:
    w, b, x = _inputs(*shape, rows, torch.float32)
    bias = b if with_bias else None
    got = Linear(w, bias)(x)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    # A different summation order than MKL's, not different math: float32 rounding of a K-term dot product.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


def _onednn_packs_bfloat16() -> bool:
    """oneDNN's bf16 GEMM needs AVX-NE-CONVERT, or AVX-512 BW+VL+DQ (its own words when it refuses)."""
    flags = read_cpu_flags()
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def test_packed_bfloat16_matches_f_linear() -> None:
    w, b, x = _inputs(3072, 576, 33, torch.bfloat16)
    lin = Linear(w, b)
    got = lin(x)
    # Packed where the CPU has oneDNN's bf16 instructions; elsewhere the F.linear fallback, as the log says.
    assert (lin.packed is not None) == _onednn_packs_bfloat16() and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-2)


def test_inputs_of_any_layout_and_rank() -> None:
    w, _, x = _inputs(96, 64, 10, torch.float32)
    lin = Linear(w)
    transposed = x.t().contiguous().t()  # same values, column-major
    assert not transposed.is_contiguous()
    torch.testing.assert_close(lin(transposed), lin(x), rtol=0, atol=0)
    assert lin(x.view(2, 5, 64)).shape == (2, 5, 96)
    assert lin(x[:0]).shape == (0, 96)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_dense_weight_round_trips() -> None:
    w, _, _ = _inputs(3072, 576, 1, torch.float32)
    assert torch.equal(Linear(w).dense_weight(), w)
    assert Linear(w, pack=False).dense_weight() is w


def test_unpacked_is_f_linear_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b, x = _inputs(576, 1536, 40, torch.float32)
    assert torch.equal(Linear(w, b, pack=False)(x), F.linear(x, w, b))
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")  # the kill switch of all our CPU kernels
    assert not onednn_usable(w)
    lin = Linear(w, b)
    assert lin.packed is None and torch.equal(lin(x), F.linear(x, w, b))


def test_not_packed_off_cpu_or_for_other_dtypes() -> None:
    assert not onednn_usable(torch.empty(8, 4, device="meta"))
    assert not onednn_usable(torch.empty(8, 4, dtype=torch.float64))
    assert not onednn_usable(torch.empty(8))
