"""Random paged-KV layouts for the Triton attention tests: scattered, shuffled, non-overlapping block tables."""

from __future__ import annotations

import pytest
import torch


def random_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, g: torch.Generator
) -> torch.Tensor:  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)


def random_block_tables(
    lens: list[int], block_size: int, num_blocks: int, g: torch.Generator, *, extra_width: int = 1
) -> torch.Tensor:  # [num_seqs, max_blocks] int64
    """Each sequence gets its own blocks, in a shuffled order; the table is wider than needed, padded with the id
    of a block no sequence owns (`poison_unread_slots` fills it with NaN: a read past seq_len shows)."""
    used = [-(-n // block_size) for n in lens]
    width = max(used) + extra_width
    assert sum(used) <= num_blocks - 1, "not enough blocks for the case"
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), width), int(perm[-1]), dtype=torch.int64)
    start = 0
    for s, n in enumerate(used):
        tables[s, :n] = perm[start : start + n]
        start += n
    return tables


def slots_of(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:  # int64
    return table.long()[positions // block_size] * block_size + positions % block_size


def poison_unread_slots(kv_cache: torch.Tensor, tables: torch.Tensor, lens: list[int]) -> None:
    """NaN into every cache slot no sequence reads: a kernel that reads one returns NaN."""
    block_size = kv_cache.shape[2]
    used = torch.zeros(kv_cache.shape[1] * block_size, dtype=torch.bool, device=kv_cache.device)
    for s, n in enumerate(lens):
        used[slots_of(tables[s], torch.arange(n, device=tables.device), block_size)] = True
    kv_cache.view(2, -1, *kv_cache.shape[3:])[:, ~used] = float("nan")


def torch_attention_backend(scale: float):  # -> engine.attention.torch_backend.TorchAttentionBackend
    """The engine's torch backend, imported on use: it pulls in kv_transfer (crc32c, protobuf), which a bare GPU box
    with only torch, triton and pytest may lack. There the tests comparing with it skip; the kernels' own run."""
    pytest.importorskip("crc32c")
    pytest.importorskip("google.protobuf")
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(scale=scale)
