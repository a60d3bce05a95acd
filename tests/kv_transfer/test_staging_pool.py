"""The staging pool (kv_transfer/staging_pool.py): a handoff of a size seen before allocates nothing, a larger one
grows the kept buffer once (at least doubling it), handoffs at once each get their own buffer, one over the keep
limit gets a one-off buffer, and every lease comes back, whatever happened inside it."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.staging_pool import ROUND_BYTES, StagingPool


def make_pool(**kwargs) -> tuple[StagingPool, list[int]]:
    sizes: list[int] = []

    def allocate(num_bytes: int) -> torch.Tensor:
        sizes.append(num_bytes)
        return torch.empty(num_bytes, dtype=torch.uint8)

    return StagingPool(allocate, **kwargs), sizes


def test_the_same_size_again_reuses_the_buffer() -> None:
    pool, sizes = make_pool()
    with pool.lease(3 * ROUND_BYTES - 5) as first:
        assert first.numel() == 3 * ROUND_BYTES
    with pool.lease(3 * ROUND_BYTES) as second, pool.lease(1) as third:  # a second handoff at once: its own
        assert second.data_ptr() == first.data_ptr() and third.data_ptr() != first.data_ptr()
    with pool.lease(ROUND_BYTES // 2) as smaller, pool.lease(2 * ROUND_BYTES) as larger:
        assert smaller.numel() == ROUND_BYTES and larger.numel() == 3 * ROUND_BYTES  # the smallest that fits
    assert sizes == [3 * ROUND_BYTES, ROUND_BYTES] and pool.num_allocated == 2 and pool.num_leased == 0


def test_a_larger_handoff_grows_the_largest_free_buffer_at_least_twofold() -> None:
    pool, sizes = make_pool(keep_bytes=64 * ROUND_BYTES)
    for num_bytes in (2 * ROUND_BYTES, 3 * ROUND_BYTES, 4 * ROUND_BYTES, 9 * ROUND_BYTES, 40 * ROUND_BYTES):
        with pool.lease(num_bytes) as buffer:
            assert buffer.numel() >= num_bytes
    # 2 MiB, then 3 MiB outgrows it (4 MiB), 4 fits, 9 outgrows (9 > 2 x 4), 40 (> 18): one allocation per step up
    assert sizes == [2 * ROUND_BYTES, 4 * ROUND_BYTES, 9 * ROUND_BYTES, 40 * ROUND_BYTES]
    assert pool.free_sizes() == [40 * ROUND_BYTES]  # the outgrown buffers were dropped


def test_a_handoff_over_the_keep_limit_gets_a_one_off_buffer() -> None:
    pool, sizes = make_pool(keep_bytes=4 * ROUND_BYTES)
    with pool.lease(ROUND_BYTES):
        pass
    with pool.lease(5 * ROUND_BYTES) as big:
        assert big.numel() == 5 * ROUND_BYTES
    assert pool.free_sizes() == [ROUND_BYTES]  # kept: the small one; the one-off is gone
    with pool.lease(5 * ROUND_BYTES):
        pass
    assert sizes == [ROUND_BYTES, 5 * ROUND_BYTES, 5 * ROUND_BYTES]


def test_at_most_max_kept_free_buffers_stay_the_largest() -> None:
    pool, _ = make_pool(max_kept=2)
    with pool.lease(ROUND_BYTES), pool.lease(2 * ROUND_BYTES), pool.lease(3 * ROUND_BYTES):
        pass
    assert pool.free_sizes() == [2 * ROUND_BYTES, 3 * ROUND_BYTES]


def test_a_lease_comes_back_when_its_handoff_fails_and_when_allocation_fails() -> None:
    pool, sizes = make_pool()
    with pytest.raises(RuntimeError, match="handoff failed"), pool.lease(ROUND_BYTES):
        raise RuntimeError("handoff failed")
    assert pool.num_leased == 0 and pool.free_sizes() == [ROUND_BYTES]

    def refuse(num_bytes: int) -> torch.Tensor:
        raise MemoryError("out of pinned memory")

    failing = StagingPool(refuse)
    with pytest.raises(MemoryError), failing.lease(ROUND_BYTES):
        pass
    assert failing.num_leased == 0 and failing.num_allocated == 1
