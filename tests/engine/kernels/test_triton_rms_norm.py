"""The Triton RMSNorm (with and without the residual add, and gathering its rows from the embedding) matches its
torch reference, which is the engine's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton.rms_norm import embed_rms_norm, rms_norm, rms_norm_reference  # noqa: E402
from engine.model import llama  # noqa: E402

EPS = 1e-5


def make_case(num_tokens, hidden, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, hidden, generator=g) * torch.rand(num_tokens, 1, generator=g) * 10).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(device, dtype, tol, with_residual):
    x, residual, weight = make_case(5, 576, dtype, device)  # SmolLM2's hidden size: not a power of two
    residual_in = residual if with_residual else None
    before = (x.clone(), residual.clone())
    got, got_residual = rms_norm(x, weight, EPS, residual_in)
    want, want_residual = rms_norm_reference(x, weight, EPS, residual_in)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got_residual, want_residual)  # one rounding of one sum: exact
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs untouched
    if not with_residual:
        assert got_residual is x


def test_strided_rows(device):
    x, _, weight = make_case(4, 64, torch.float32, device, seed=1)
    wide = torch.zeros(4, 100, device=device)
    wide[:, :64] = x
    got, _ = rms_norm(wide[:, :64], weight, EPS)
    torch.testing.assert_close(got, rms_norm_reference(x, weight, EPS)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_engines_rms_norm(dtype):
    x, residual, weight = make_case(7, 576, dtype, "cpu", seed=2)
    want = llama.rms_norm(x, weight, EPS)
    assert torch.equal(rms_norm_reference(x, weight, EPS)[0], want)
    # With the residual: the model's `hidden.add_(delta)` then `rms_norm(hidden)`.
    hidden = residual.clone()
    hidden.add_(x)
    got, new_residual = rms_norm_reference(x, weight, EPS, residual)
    assert torch.equal(new_residual, hidden)
    assert torch.equal(got, llama.rms_norm(hidden, weight, EPS))


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_embed_gather_is_the_lookup_then_the_norm(device, ids_dtype):
    """embed_rms_norm(ids) is rms_norm(F.embedding(ids)) in one launch: the residual is the gathered rows exactly,
    the normed rows the same bits as the kernel's plain norm of them (repeated and unordered ids)."""
    embed, _, weight = make_case(50, 576, torch.float16, device, seed=3)
    ids = torch.tensor([7, 0, 49, 7, 13], dtype=ids_dtype, device=device)
    got, got_residual = embed_rms_norm(ids, embed, weight, EPS)
    rows = torch.nn.functional.embedding(ids.long(), embed)
    assert torch.equal(got_residual, rows)
    assert torch.equal(got, rms_norm(rows, weight, EPS)[0])
    torch.testing.assert_close(got, rms_norm_reference(rows, weight, EPS)[0], rtol=2e-3, atol=2e-3)
    assert embed_rms_norm(ids[:0], embed, weight, EPS)[0].shape == (0, 576)


def test_refuses_mismatched_weight():
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(torch.zeros(2, 8), torch.zeros(7), EPS)
    with pytest.raises(AssertionError, match="weight is"):
        rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.float16), EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 2048, 4096])
def test_full_size_gpu(dtype, hidden):
    x, residual, weight = make_case(4096, hidden, dtype, "cuda", seed=hidden)
    for residual_in in (None, residual):
        got, got_residual = rms_norm(x, weight, EPS, residual_in)
        want, want_residual = rms_norm_reference(x, weight, EPS, residual_in)
        assert torch.equal(got_residual, want_residual)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the normalised row rounds to 16 bits before the weight: a unit apart there, now and then
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    ids = torch.randint(0, x.shape[0], (8192,), generator=torch.Generator().manual_seed(hidden)).cuda()
    gathered, first_residual = embed_rms_norm(ids, x, weight, EPS)
    assert torch.equal(first_residual, x[ids])
    assert torch.equal(gathered, rms_norm(x[ids], weight, EPS)[0])
