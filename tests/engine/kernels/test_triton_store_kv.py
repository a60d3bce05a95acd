"""The Triton KV store writes exactly the reference's slots, skips padding (-1), and agrees with the torch
backend's store."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.kernels.triton.store_kv import store_kv, store_kv_reference  # noqa: E402
from tests.engine.kernels.paged_kv_cases import torch_attention_backend  # noqa: E402


def qkv_views(num_tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, g: torch.Generator, device):
    """k and v as the model passes them: strided views of one fused qkv row."""
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(device)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_matches_reference_and_skips_padding(device, dtype, slot_dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, dim = 8, 4, 3, 32
    k, v = qkv_views(6, 9, kv_heads, dim, dtype, g, device)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype).to(device)
    slots = torch.tensor([5, -1, 31, 0, -1, 17], dtype=slot_dtype, device=device)  # unordered, two padding tokens
    want = cache.clone()
    store_kv_reference(k, v, want, slots)
    got = cache.clone()
    store_kv(k, v, got, slots)
    assert torch.equal(got, want)
    # The padding tokens' K/V landed nowhere: only the four real slots changed.
    changed = (got != cache).view(2, -1, kv_heads * dim).any(-1).any(0)
    assert changed.nonzero().flatten().tolist() == [0, 5, 17, 31]


def test_reference_matches_torch_backend_store():
    g = torch.Generator().manual_seed(1)
    k, v = qkv_views(5, 4, 2, 16, torch.float32, g, "cpu")
    cache = torch.zeros(2, 4, 4, 2, 16)
    slots = torch.tensor([3, 4, 9, 15, 0])
    meta = AttentionMetadata(
        num_tokens=5,
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64),
        prefills=(),
    )
    backend_cache = cache.clone()
    torch_attention_backend(0.25).forward(torch.zeros(5, 4, 16), k, v, backend_cache, meta)
    store_kv_reference(k, v, cache, slots)
    assert torch.equal(cache, backend_cache)


def test_refuses_mismatched_cache():
    k = torch.zeros(2, 3, 32)
    with pytest.raises(AssertionError, match="does not fit"):
        store_kv(k, k, torch.zeros(2, 4, 4, 2, 32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(AssertionError, match="dtypes differ"):
        store_kv(k, k, torch.zeros(2, 4, 4, 3, 32, dtype=torch.float16), torch.zeros(2, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_full_size_gpu(dtype):
    g = torch.Generator().manual_seed(2)
    num_tokens, num_blocks, block_size, kv_heads, dim = 8192, 4096, 16, 8, 64
    k, v = qkv_views(num_tokens, 32, kv_heads, dim, dtype, g, "cuda")
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype).cuda()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].cuda()
    slots[::7] = -1
    want = cache.clone()
    store_kv_reference(k, v, want, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, want)
