"""The Triton SiLU-and-multiply matches its torch reference (float32 math), which is the engine's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton.silu_and_mul import silu_and_mul, silu_and_mul_reference  # noqa: E402
from engine.model import llama  # noqa: E402


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (3, 2 * 1500), (2, 10)])  # wider than one block; tiny
def test_matches_reference(device, dtype, tol, shape):
    g = torch.Generator().manual_seed(shape[1])
    gate_up = (torch.randn(*shape, generator=g) * 4).to(dtype).to(device)
    got = silu_and_mul(gate_up)
    want = silu_and_mul_reference(gate_up)
    assert got.shape == (shape[0], shape[1] // 2) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_strided_rows(device):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 50, generator=g).to(device)
    torch.testing.assert_close(silu_and_mul(wide[:, :40]), silu_and_mul_reference(wide[:, :40].contiguous()))


def test_reference_is_the_engines_silu_and_mul():
    gate_up = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4
    assert torch.equal(silu_and_mul_reference(gate_up), llama.silu_and_mul(gate_up))
    # bfloat16: the engine rounds silu(gate) before the product, the reference once at the end.
    torch.testing.assert_close(
        silu_and_mul_reference(gate_up.bfloat16()).float(), llama.silu_and_mul(gate_up.bfloat16()).float(),
        rtol=2e-2, atol=2e-2,
    )


def test_refuses_odd_width():
    with pytest.raises(AssertionError, match="even"):
        silu_and_mul(torch.zeros(2, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("inter", [1536, 8192])  # SmolLM2-135M, Llama-3.2-1B
def test_full_size_gpu(dtype, inter):
    gate_up = (torch.randn(4096, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype).cuda()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # float32: the GPU's exp is a few units off libm's
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), rtol=tol, atol=tol)
