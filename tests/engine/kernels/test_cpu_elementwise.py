"""The fused elementwise kernels give the same bits as the torch expressions they replace (HF's own)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu_elementwise import load_elementwise
from engine.model import llama
from engine.model.rope import RotaryEmbedding


@pytest.fixture(scope="module")
def kernel():
    module = load_elementwise()
    assert module is not None, "the C++ kernels must build on the CI machine (gcc and ninja are dependencies)"
    return module


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:  # transformers' rotate_half, written out
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rope_in_place_on_qkv_views_is_bit_identical(kernel, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    heads, kv_heads, dim = 9, 3, 64
    rope = RotaryEmbedding(head_dim=dim, max_positions=2048, theta=100000.0, scaling=None, dtype=torch.float32)
    positions = torch.randint(0, 2048, (num_tokens,), generator=g)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)  # strided views, as the model passes them
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want_q = q * cos + hf_rotate_half(q) * sin
    want_k = k * cos + hf_rotate_half(k) * sin

    got_q, got_k = rope(rope.cos_sin(positions), q, k)

    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


def test_rope_torch_path_for_other_dtypes_is_unchanged():
    rope = RotaryEmbedding(head_dim=8, max_positions=16, theta=10000.0, scaling=None, dtype=torch.bfloat16)
    q, k = torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 1, 8).bfloat16()
    positions = torch.tensor([0, 5, 15])
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    got_q, got_k = rope(rope.cos_sin(positions), q.clone(), k.clone())
    assert torch.equal(got_q, q * cos + hf_rotate_half(q) * sin)
    assert torch.equal(got_k, k * cos + hf_rotate_half(k) * sin)


@pytest.mark.parametrize("num_tokens", [1, 5, 513])
def test_rms_norm_is_bit_identical_to_hf(kernel, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 576, generator=g) * torch.rand(num_tokens, 1, generator=g) * 10
    weight = torch.randn(576, generator=g)
    eps = 1e-5
    # transformers' LlamaRMSNorm.forward, written out
    xf = x.to(torch.float32)
    want = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    assert torch.equal(llama.rms_norm(x, weight, eps), want)
    assert torch.equal(kernel.rms_norm_scale(x, xf.pow(2).mean(-1, keepdim=True), weight, eps), want)


def test_kernels_refuse_bad_arguments(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel.rope_(torch.zeros(2, 1, 4, dtype=torch.float64), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="cos/sin"):
        kernel.rope_(torch.zeros(2, 1, 4), torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match="w: "):
        kernel.rms_norm_scale(torch.zeros(2, 4), torch.zeros(2), torch.zeros(5), 1e-5)


@pytest.mark.parametrize("shape", [(1, 1536), (37, 1536), (300, 1536), (3, 40), (2, 48), (2, 64), (1, 5)])
def test_silu_and_mul_is_bit_identical_to_torch(kernel, shape):
    num_tokens, n = shape
    g = torch.Generator().manual_seed(num_tokens)
    gate_up = torch.randn(num_tokens, 2 * n, generator=g) * 6  # wide enough to reach exp's extremes
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up

    assert torch.equal(kernel.silu_and_mul(gate_up), want)
    assert torch.equal(llama.silu_and_mul(gate_up), want)


def test_without_the_kernels_the_torch_expressions_run(monkeypatch):
    monkeypatch.setattr(llama, "load_elementwise", lambda: None)
    x, weight, gate_up = torch.randn(4, 16), torch.randn(16), torch.randn(4, 32)
    xf = x.float()
    want = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(llama.rms_norm(x, weight, 1e-6), want)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(llama.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
