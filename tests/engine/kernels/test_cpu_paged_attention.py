"""The C++ paged decode kernel and the torch backend's decode path both match the plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_paged_attention import (
    load_kernel,
    paged_decode_attention,
    paged_decode_attention_reference,
)


def make_case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.sort(torch.randint(1, 5 * block_size, (num_seqs,), generator=g)).values
    seq_lens[0] = 1  # a sequence attending only to itself
    width = int((seq_lens.max() + block_size - 1) // block_size)
    # Scattered, non-overlapping blocks; padding entries are 0 and must never be read past seq_len.
    perm = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width)
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)
    for s in range(num_seqs):
        used = int((seq_lens[s] + block_size - 1) // block_size)
        tables[s, :used] = perm[s, :used]
    return q, k_cache, v_cache, tables, seq_lens


SHAPES = [
    # num_seqs, num_heads, num_kv_heads, head_dim, block_size
    (5, 9, 3, 64, 16),  # SmolLM2: GQA 3:1
    (4, 8, 1, 128, 16),  # MQA, head_dim 128
    (3, 4, 4, 32, 8),  # MHA, a head size without a specialised path
]


@pytest.fixture(scope="module")
def kernel():
    module = load_kernel()
    assert module is not None, "the C++ kernel must build on the CI machine (gcc and ninja are dependencies)"
    return module


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference_float32(kernel, shape):
    q, k, v, tables, lens = make_case(*shape, dtype=torch.float32)
    got = paged_decode_attention(q, k, v, tables, lens, 0.125)
    want = paged_decode_attention_reference(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_matches_reference_bfloat16(kernel):
    q, k, v, tables, lens = make_case(*SHAPES[0], dtype=torch.bfloat16)
    got = paged_decode_attention(q, k, v, tables, lens, 0.125)
    want = paged_decode_attention_reference(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_kernel_ignores_blocks_past_the_sequence(kernel):
    q, k, v, tables, lens = make_case(*SHAPES[0], dtype=torch.float32)
    before = paged_decode_attention(q, k, v, tables, lens, 0.125)
    # Poison every cache slot no sequence reads: results must not change.
    used = torch.zeros(k.shape[0] * k.shape[1], dtype=torch.bool)
    for s in range(len(lens)):
        pos = torch.arange(int(lens[s]))
        used[tables[s, pos // k.shape[1]] * k.shape[1] + pos % k.shape[1]] = True
    k.view(-1, *k.shape[2:])[~used] = float("nan")
    v.view(-1, *v.shape[2:])[~used] = float("nan")
    after = paged_decode_attention(q, k, v, tables, lens, 0.125)
    assert torch.equal(before, after)


@pytest.mark.parametrize("num_threads", [1, 2, 3, 7])
def test_work_split_across_threads_covers_every_sequence_once(kernel, num_threads):
    """The kernel splits the sequences (sorted by length) at equal shares of context per thread: every thread
    count, including more threads than the split can use, gives each sequence exactly its own result."""
    q, k, v, tables, lens = make_case(12, 9, 3, 64, 16, dtype=torch.float32, seed=3)  # lengths ascending
    want = paged_decode_attention_reference(q, k, v, tables, lens, 0.125)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = paged_decode_attention(q, k, v, tables, lens, 0.125)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_torch_backend_decode_matches_reference(shape):
    q, k, v, tables, lens = make_case(*shape, dtype=torch.float32)
    meta = AttentionMetadata(
        num_tokens=len(lens),
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_seq_lens=lens,
        prefills=(),
    )
    got = TorchAttentionBackend(scale=0.125).decode(q, torch.stack([k, v]), meta)
    want = paged_decode_attention_reference(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
