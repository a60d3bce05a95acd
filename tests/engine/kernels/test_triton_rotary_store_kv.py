"""The fused rotary + KV store: the torch reference's result, and bit for bit what the two launches it replaces
(`rotary` then `store_kv`) leave in q and in the cache; padding tokens (-1) store nothing; k is not written."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton.rotary import rotary  # noqa: E402
from engine.kernels.triton.rotary_store_kv import rotary_store_kv, rotary_store_kv_reference  # noqa: E402
from engine.kernels.triton.store_kv import store_kv  # noqa: E402
from engine.model.rope import RotaryEmbedding  # noqa: E402


def make_case(num_tokens, heads, kv_heads, dim, dtype, device, *, num_blocks=8, block_size=4, max_positions=2048,
              seed=0):
    """q, k, v as the model passes them (strided views of one fused qkv row), rope.py's tables, a random cache."""
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim=dim, max_positions=max_positions, theta=100000.0, scaling=None, dtype=dtype)
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype).to(device)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=g).to(device)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype).to(device)
    return qkv, q, k, v, positions, rope.cos.to(device), rope.sin.to(device), cache


def two_launches(qkv, heads, kv_heads, dim, positions, cos, sin, cache, slots):
    """What the model ran before: rotary in place on q and k, then store_kv; -> (qkv, cache) afterwards."""
    qkv, cache = qkv.clone(), cache.clone()
    n = qkv.shape[0]
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    rotary(q, k, positions, cos, sin)
    store_kv(k, v, cache, slots)
    return qkv, cache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])  # as test_triton_rotary.py
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 32)])  # GQA and MHA
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_matches_reference_and_the_two_launches(device, dtype, tol, shape, index_dtype):
    heads, kv_heads, dim = shape
    qkv, q, k, v, positions, cos, sin, cache = make_case(6, *shape, dtype, device)
    positions = positions.to(index_dtype)
    slots = torch.tensor([5, -1, 31, 0, -1, 17], dtype=index_dtype, device=device)  # unordered, two padding tokens
    before = qkv.clone()

    want_q, want_cache = q.clone(), cache.clone()
    rotary_store_kv_reference(want_q, k.clone(), v, want_cache, slots, positions, cos, sin)
    two_qkv, two_cache = two_launches(before, heads, kv_heads, dim, positions, cos, sin, cache, slots)
    got_cache = cache.clone()
    rotary_store_kv(q, k, v, got_cache, slots, positions, cos, sin)

    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(got_cache, want_cache, rtol=tol, atol=tol)
    # The same bits as rotary + store_kv: q (every token, padding too) and the whole cache.
    assert torch.equal(qkv[:, : heads * dim], two_qkv[:, : heads * dim])
    assert torch.equal(got_cache, two_cache)
    assert torch.equal(qkv[:, heads * dim :], before[:, heads * dim :])  # k and v themselves untouched
    changed = (got_cache != cache).view(2, -1, kv_heads * dim).any(-1).any(0)
    assert changed.nonzero().flatten().tolist() == [0, 5, 17, 31]  # the four real slots, nothing else


def test_reference_is_rotary_then_store(device):
    """The reference is the two references composed; checked against the torch rotary of rope.py once more."""
    heads, kv_heads, dim = 4, 2, 16
    qkv, q, k, v, positions, cos, sin, cache = make_case(5, heads, kv_heads, dim, torch.float32, "cpu", seed=3)
    slots = torch.tensor([3, 4, 9, 15, 0])
    rope = RotaryEmbedding(head_dim=dim, max_positions=2048, theta=100000.0, scaling=None, dtype=torch.float32)
    want_q, want_k = rope(rope.cos_sin(positions), q.clone(), k.clone())
    got_q, got_cache = q.clone(), cache.clone()
    rotary_store_kv_reference(got_q, k, v, got_cache, slots, positions, cos, sin)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_cache[0].view(-1, kv_heads, dim)[slots], want_k)
    assert torch.equal(got_cache[1].view(-1, kv_heads, dim)[slots], v)


def test_refuses_a_cache_of_another_dtype():
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(AssertionError, match="dtypes differ"):
        rotary_store_kv(q, k, k, cache, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                        torch.zeros(16, 8), torch.zeros(16, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 64)])  # SmolLM2-135M, Llama-3.2-1B
def test_full_size_gpu(dtype, shape):
    heads, kv_heads, dim = shape
    num_tokens, num_blocks, block_size = 8192, 1024, 16
    qkv, q, k, v, positions, cos, sin, cache = make_case(num_tokens, *shape, dtype, "cuda", num_blocks=num_blocks,
                                                         block_size=block_size, max_positions=8192, seed=2)
    g = torch.Generator().manual_seed(4)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].cuda()
    slots[::7] = -1
    two_qkv, two_cache = two_launches(qkv, heads, kv_heads, dim, positions, cos, sin, cache, slots)
    want_q, want_cache = q.clone(), cache.clone()
    rotary_store_kv_reference(want_q, k.clone(), v, want_cache, slots, positions, cos, sin)
    rotary_store_kv(q, k, v, cache, slots, positions, cos, sin)
    assert torch.equal(qkv[:, : heads * dim], two_qkv[:, : heads * dim])
    assert torch.equal(cache, two_cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(cache.float(), want_cache.float(), rtol=tol, atol=tol)
