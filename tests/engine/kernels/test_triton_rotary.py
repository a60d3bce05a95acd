"""The Triton rotary embedding (in place, neox / rotate_half) matches its torch reference, which is rope.py's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton.rotary import rotary, rotary_reference  # noqa: E402
from engine.model.rope import RotaryEmbedding  # noqa: E402


def make_case(num_tokens, heads, kv_heads, dim, dtype, device, max_positions=2048, seed=0):
    """q and k as the model passes them: strided views of one fused qkv row; rope.py's real tables."""
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim=dim, max_positions=max_positions, theta=100000.0, scaling=None, dtype=dtype)
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype).to(device)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=g).to(device)
    return rope, qkv, q, k, positions, rope.cos.to(device), rope.sin.to(device)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])  # GPUs may fuse a*b-c*d
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 32)])  # GQA and MHA
def test_in_place_matches_reference(device, dtype, tol, shape):
    _, qkv, q, k, positions, cos, sin = make_case(5, *shape, dtype, device)
    heads, kv_heads, dim = shape
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    want_q, want_k = rotary_reference(q, k, positions.int(), cos, sin)
    rotary(q, k, positions.int(), cos, sin)
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, want_k, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v, beside them, untouched


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.0), (torch.bfloat16, 3e-2)])
def test_reference_is_rope_py(dtype, tol):
    rope, _, q, k, positions, cos, sin = make_case(7, 9, 3, 64, dtype, "cpu", seed=1)
    want_q, want_k = rope(rope.cos_sin(positions), q.clone(), k.clone())
    got_q, got_k = rotary_reference(q, k, positions, cos, sin)
    # float32: the same operations; bfloat16: rope.py rounds each product, the reference once at the end.
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), want_k.float(), rtol=tol, atol=tol)


def test_refuses_bad_tables():
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    with pytest.raises(AssertionError, match="cos/sin"):
        rotary(q, k, torch.zeros(2, dtype=torch.int64), torch.zeros(16, 6), torch.zeros(16, 6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 64)])  # SmolLM2-135M, Llama-3.2-1B
def test_full_size_gpu(dtype, shape):
    _, _, q, k, positions, cos, sin = make_case(8192, *shape, dtype, "cuda", max_positions=8192, seed=2)
    want_q, want_k = rotary_reference(q, k, positions, cos, sin)
    rotary(q, k, positions, cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(k.float(), want_k.float(), rtol=tol, atol=tol)
