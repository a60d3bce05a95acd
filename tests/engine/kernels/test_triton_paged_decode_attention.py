"""The Triton paged decode attention matches its torch reference, which matches the engine's torch backend.

Interpreter sizes: a few sequences, lengths off block boundaries, one token, GQA ratios 1 and 3, split-K off and
on (several partition sizes, the same result), int32 and int64 tables, scattered shuffled blocks, and NaN in every
slot no sequence reads. bfloat16 runs only on the GPU: Triton 3.6's interpreter multiplies bfloat16 bit patterns
as integers in tl.dot (float16 covers the 16-bit path there).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.kernels.triton.paged_decode_attention import (  # noqa: E402
    BLOCK_N,
    WIDE_BLOCK_N,
    choose_block_n_and_stages,
    choose_partition_size,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from tests.engine.kernels.paged_kv_cases import (  # noqa: E402
    poison_unread_slots,
    random_block_tables,
    random_cache,
    torch_attention_backend,
)

SCALE = 0.125


def make_case(lens, heads, kv_heads, dim, block_size, dtype, device, seed=0, num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_blocks or sum(-(-n // block_size) for n in lens) + 2
    cache = random_cache(num_blocks, block_size, kv_heads, dim, dtype, g)
    tables = random_block_tables(lens, block_size, num_blocks, g)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    return q.to(device), cache.to(device), tables.to(device), seq_lens.to(device)


CASES = [
    # lens, heads, kv_heads, head_dim, block_size
    ([1, 13, 70], 9, 3, 64, 16),  # SmolLM2's GQA 3:1; one token; lengths off block boundaries
    ([5, 33], 4, 4, 32, 8),  # GQA ratio 1 (MHA)
]


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_split_off_and_on(device, case):
    lens, heads, kv_heads, dim, block_size = case
    q, cache, tables, seq_lens = make_case(lens, heads, kv_heads, dim, block_size, torch.float32, device)
    poison_unread_slots(cache, tables, lens)
    want = paged_decode_attention_reference(q, cache, tables, seq_lens, SCALE)
    assert not want.isnan().any()
    unsplit = paged_decode_attention(q, cache, tables, seq_lens, SCALE, partition_size=4 * BLOCK_N)
    split = paged_decode_attention(q, cache, tables, seq_lens, SCALE, partition_size=BLOCK_N)  # 3 splits
    torch.testing.assert_close(unsplit, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=1e-5)


def test_float16_int32_tables_and_a_padding_row(device):
    """int32 block tables (a column slice of a wider tensor) and seq_lens, float16, and a length-0 row (a padded
    batch) that gets zeros."""
    lens = [40, 0, 7]
    q, cache, tables, seq_lens = make_case(lens, 8, 2, 32, 16, torch.float16, device, seed=3)
    wide = torch.full((len(lens), tables.shape[1] + 5), -7, dtype=torch.int32, device=device)
    wide[:, : tables.shape[1]] = tables
    tables, seq_lens = wide[:, : tables.shape[1]], seq_lens.int()
    assert not tables.is_contiguous()
    want = paged_decode_attention_reference(q, cache, tables, seq_lens, SCALE)
    for partition_size in (BLOCK_N, 2 * BLOCK_N):
        got = paged_decode_attention(q, cache, tables, seq_lens, SCALE, partition_size=partition_size)
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-3, atol=5e-3)  # p rounds to float16
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_reference_matches_torch_backend():
    lens = [1, 13, 33, 70]  # ascending, as the runner orders decodes
    q, cache, tables, seq_lens = make_case(lens, 9, 3, 64, 16, torch.float32, "cpu", seed=4)
    meta = AttentionMetadata(
        num_tokens=len(lens),
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_seq_lens=seq_lens,
        prefills=(),
    )
    want = torch_attention_backend(SCALE).decode(q, cache, meta)
    got = paged_decode_attention_reference(q, cache, tables, seq_lens, SCALE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_partition_size_heuristic():
    # A big batch already fills the GPU: no split. A small batch of long contexts splits, never below the minimum.
    assert choose_partition_size(256, 8, 4096) >= 4096
    small = choose_partition_size(2, 3, 4096)
    assert small % BLOCK_N == 0 and 64 <= small < 256  # a handful of sequences: short partitions side by side
    assert choose_partition_size(16, 8, 4096) == 256  # 128 programs: the usual minimum
    assert choose_partition_size(1, 1, 100) >= 100  # short: never split
    assert choose_partition_size(32, 8, 2048) == 256  # 256 programs: split 8 ways (the H200 sweep's best)
    assert choose_partition_size(64, 8, 2048) >= 2048  # 512 programs: enough already


def test_launch_shape_heuristic():
    assert choose_block_n_and_stages(1, 3, torch.bfloat16) == (BLOCK_N, 1)  # latency-bound: short, unpipelined steps
    assert choose_block_n_and_stages(256, 8, torch.bfloat16) == (WIDE_BLOCK_N, 2)  # bandwidth-bound
    assert choose_block_n_and_stages(256, 8, torch.float32) == (BLOCK_N, 1)  # float32 tiles stay small


def test_wide_steps_and_pipelining_match_the_reference(device):
    lens = [1, 63, 64, 65, 200]
    q, cache, tables, seq_lens = make_case(lens, 8, 2, 64, 16, torch.float32, device.type, seed=3)
    want = paged_decode_attention_reference(q, cache, tables, seq_lens, SCALE)
    for block_n, stages, partition_size in ((WIDE_BLOCK_N, 2, None), (WIDE_BLOCK_N, 2, WIDE_BLOCK_N), (16, 3, 64)):
        got = paged_decode_attention(q, cache, tables, seq_lens, SCALE, block_n=block_n, stages=stages,
                                     partition_size=partition_size)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_refuses_bad_shapes():
    q, cache, tables, seq_lens = make_case([3], 6, 4, 16, 4, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="not a multiple"):
        paged_decode_attention(q, cache, tables, seq_lens, SCALE)
    q, cache, tables, seq_lens = make_case([3], 4, 2, 16, 4, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="multiple of"):
        paged_decode_attention(q, cache, tables, seq_lens, SCALE, partition_size=BLOCK_N + 1)
    with pytest.raises(AssertionError, match="cache"):
        paged_decode_attention(q.half(), cache, tables, seq_lens, SCALE)


GPU_SHAPES = [
    # heads, kv_heads, head_dim: SmolLM2-135M, Llama-3.2-1B
    (9, 3, 64),
    (32, 8, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("num_seqs,max_len", [(256, 1024), (8, 4096), (1, 4096)])
def test_full_size_gpu(dtype, shape, num_seqs, max_len):
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g).tolist()
    lens[0] = max_len
    q, cache, tables, seq_lens = make_case(lens, heads, kv_heads, dim, 16, dtype, "cuda", seed=num_seqs)
    want = paged_decode_attention_reference(q, cache, tables, seq_lens, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = paged_decode_attention(q, cache, tables, seq_lens, SCALE)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    unsplit = paged_decode_attention(q, cache, tables, seq_lens, SCALE, partition_size=max_len)
    torch.testing.assert_close(unsplit.float(), want.float(), rtol=tol, atol=tol)
