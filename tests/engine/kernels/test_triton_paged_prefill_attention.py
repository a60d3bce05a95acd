"""The Triton paged prefill attention matches its torch reference, which matches the engine's torch backend.

Interpreter sizes: in one launch a fresh prefill (context == query), an extend after a cached prefix whose
queries span two query tiles, and a one-token extend; GQA ratios 1 and 3; scattered shuffled blocks; NaN in every
slot no request reads. bfloat16 runs only on the GPU (Triton 3.6's interpreter computes bfloat16 tl.dot on the
raw bit patterns).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.metadata import AttentionMetadata, PrefillChunk  # noqa: E402
from engine.kernels.triton.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from engine.kernels.triton.store_kv import store_kv  # noqa: E402
from tests.engine.kernels.paged_kv_cases import (  # noqa: E402
    poison_unread_slots,
    random_block_tables,
    random_cache,
    slots_of,
    torch_attention_backend,
)

SCALE = 0.125


def make_case(query_lens, context_lens, heads, kv_heads, dim, block_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 2
    cache = random_cache(num_blocks, block_size, kv_heads, dim, dtype, g)
    tables = random_block_tables(context_lens, block_size, num_blocks, g)
    q = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int64)
    return q.to(device), cache.to(device), tables.to(device), cu.to(device), torch.tensor(context_lens).to(device)


CASES = [
    # query_lens, context_lens, heads, kv_heads, head_dim, block_size
    ([5, 36, 1], [5, 70, 33], 6, 2, 32, 16),  # fresh; prefix 34 + 36 queries (two 32-row tiles); one-token extend
    ([12, 3], [12, 20], 2, 2, 32, 8),  # GQA ratio 1
]


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(device, case):
    query_lens, context_lens, *shape = case
    q, cache, tables, cu, ctx = make_case(query_lens, context_lens, *shape, torch.float32, device)
    poison_unread_slots(cache, tables, context_lens)
    want = paged_prefill_attention_reference(q, cache, tables, cu, ctx, SCALE)
    assert not want.isnan().any()
    got = paged_prefill_attention(q, cache, tables, cu, ctx, SCALE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_float16_int32_metadata(device):
    query_lens, context_lens = [20, 1], [50, 9]
    q, cache, tables, cu, ctx = make_case(query_lens, context_lens, 4, 2, 32, 16, torch.float16, device, seed=1)
    tables, cu, ctx = tables.int(), cu.int(), ctx.int()
    want = paged_prefill_attention_reference(q, cache, tables, cu, ctx, SCALE)
    got = paged_prefill_attention(q, cache, tables, cu, ctx, SCALE, max_query_len=20)
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-3, atol=5e-3)  # p rounds to float16 for tl.dot


def backend_step(q, k, v, cache, tables, query_lens, context_lens):
    """The same requests as the torch backend sees them: slot mapping and one PrefillChunk each."""
    block_size = cache.shape[2]
    chunks, slot_mapping, start = [], [], 0
    for s, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        positions = torch.arange(context_len - query_len, context_len)
        slot_mapping.append(slots_of(tables[s], positions, block_size))
        fresh = query_len == context_len
        context_slots = None if fresh else slots_of(tables[s], torch.arange(context_len), block_size)
        chunks.append(
            PrefillChunk(query_start=start, query_len=query_len, context_len=context_len, context_slots=context_slots)
        )
        start += query_len
    meta = AttentionMetadata(
        num_tokens=start,
        slot_mapping=torch.cat(slot_mapping),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64),
        prefills=tuple(chunks),
    )
    return torch_attention_backend(SCALE).forward(q, k, v, cache, meta), meta


def test_reference_matches_torch_backend():
    """store_kv_reference-free: the backend stores the new K/V itself; the reference then reads that cache."""
    query_lens, context_lens = [5, 40, 1, 16], [5, 70, 33, 16]
    q, cache, tables, cu, ctx = make_case(query_lens, context_lens, 9, 3, 64, 16, torch.float32, "cpu", seed=2)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(q.shape[0], 3, 64, generator=g)
    v = torch.randn(q.shape[0], 3, 64, generator=g)
    want, meta = backend_step(q, k, v, cache, tables, query_lens, context_lens)
    got = paged_prefill_attention_reference(q, cache, tables, cu, ctx, SCALE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_store_then_attend_matches_torch_backend(device):
    """The Triton pair (store_kv, then prefill attention) gives the torch backend's step output."""
    query_lens, context_lens = [6, 9], [6, 21]
    q, cache, tables, cu, ctx = make_case(query_lens, context_lens, 4, 2, 16, 4, torch.float32, "cpu", seed=5)
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(q.shape[0], 2, 16, generator=g), torch.randn(q.shape[0], 2, 16, generator=g)
    backend_cache = cache.clone()
    want, meta = backend_step(q, k, v, backend_cache, tables, query_lens, context_lens)
    cache, q, k, v, tables, cu, ctx = (t.to(device) for t in (cache, q, k, v, tables, cu, ctx))
    store_kv(k, v, cache, meta.slot_mapping.to(device))
    assert torch.equal(cache.cpu(), backend_cache)
    got = paged_prefill_attention(q, cache, tables, cu, ctx, SCALE)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_refuses_bad_metadata():
    q, cache, tables, cu, ctx = make_case([2], [2], 4, 2, 16, 4, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="cu_seqlens_q"):
        paged_prefill_attention(q, cache, tables, cu[:1], ctx, SCALE)
    with pytest.raises(AssertionError, match="context_lens"):
        paged_prefill_attention(q, cache, tables, cu, torch.cat([ctx, ctx]), SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 64)])  # SmolLM2-135M, Llama-3.2-1B
def test_full_size_gpu(dtype, shape):
    heads, kv_heads, dim = shape
    # A 4096-token fresh prompt, a 1000-token extend after a 3000-token prefix, a 1-token extend, short ones.
    query_lens = [4096, 1000, 1, 77, 300]
    context_lens = [4096, 4000, 2049, 77, 812]
    q, cache, tables, cu, ctx = make_case(query_lens, context_lens, heads, kv_heads, dim, 16, dtype, "cuda", seed=7)
    want = paged_prefill_attention_reference(q, cache, tables, cu, ctx, SCALE)
    got = paged_prefill_attention(q, cache, tables, cu, ctx, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
