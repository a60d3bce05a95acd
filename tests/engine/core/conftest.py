"""Shared checks for the control-plane tests: every workload ends with every block back in the pool."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.core.block_pool import BlockPool


def check_all_blocks_free(pool: BlockPool) -> None:
    """Every block is unreferenced and on the free list exactly once (cached or not)."""
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.num_used_blocks == 0
    assert sorted(pool.free_block_ids()) == list(range(pool.num_blocks))
    assert [b.block_id for b in pool.blocks if b.ref_cnt != 0] == []
    # Every cached hash still points at a block that carries that hash.
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.get_cached_block(block.block_hash) is block


@pytest.fixture
def assert_all_blocks_free() -> Callable[[BlockPool], None]:
    return check_all_blocks_free
