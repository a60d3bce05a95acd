"""BlockPool on exact state: block ids, ref counts, free-list (eviction) order, cached hashes and events."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.core.block_pool import BlockPool, BlockPoolError, KVBlock
from kv_transfer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

AllFree = Callable[[BlockPool], None]


def h(i: int) -> bytes:
    """A distinct 16-byte stand-in hash; the pool treats hashes as opaque keys."""
    return i.to_bytes(16, "little")


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def test_fresh_pool() -> None:
    pool = BlockPool(4)
    assert pool.num_blocks == 4
    assert pool.num_free_blocks == 4
    assert pool.num_used_blocks == 0
    assert pool.usage == 0.0
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert pool.num_cached_blocks == 0
    assert refs(pool) == [0, 0, 0, 0]
    assert pool.take_events() == []


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_num_blocks_must_be_positive(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_allocate_takes_from_the_front_in_id_order(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    assert ids(a) == [0, 1]
    b = pool.allocate(3)
    assert ids(b) == [2, 3, 4]
    assert refs(pool) == [1, 1, 1, 1, 1, 0]
    assert pool.free_block_ids() == [5]
    assert pool.num_free_blocks == 1
    assert pool.num_used_blocks == 5
    assert pool.usage == 5 / 6
    assert pool.allocate(0) == []
    assert pool.free_block_ids() == [5]

    pool.free(a)
    pool.free(b)
    assert pool.free_block_ids() == [5, 0, 1, 2, 3, 4]
    assert pool.take_events() == []
    assert_all_blocks_free(pool)


def test_free_order_is_eviction_order(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(4)  # 0..3; block 4 never used
    pool.free([blocks[2], blocks[0]])
    assert pool.free_block_ids() == [4, 2, 0]
    pool.free(reversed([blocks[1], blocks[3]]))  # tail first
    assert pool.free_block_ids() == [4, 2, 0, 3, 1]

    # Never-used blocks go first, then freed blocks, least recently freed first.
    assert ids(pool.allocate(1)) == [4]
    assert ids(pool.allocate(2)) == [2, 0]
    assert pool.free_block_ids() == [3, 1]
    pool.free([blocks[0], blocks[2]])
    assert pool.free_block_ids() == [3, 1, 0, 2]
    pool.free([pool.blocks[4]])
    assert pool.free_block_ids() == [3, 1, 0, 2, 4]
    assert_all_blocks_free(pool)


def test_over_allocation_raises_and_changes_nothing(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(3)
    held = pool.allocate(2)
    with pytest.raises(BlockPoolError, match="asked for 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [2]
    assert refs(pool) == [1, 1, 0]
    pool.free(held)
    with pytest.raises(BlockPoolError):
        pool.allocate(4)
    assert pool.free_block_ids() == [2, 0, 1]
    assert_all_blocks_free(pool)


def test_double_free_raises(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(BlockPoolError, match="block 0 freed twice"):
        pool.free([a])
    assert pool.free_block_ids() == [2, 0]
    assert refs(pool) == [0, 1, 0]
    pool.free([b])
    assert_all_blocks_free(pool)


def test_never_allocated_block_cannot_be_freed() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match="block 1 freed twice"):
        pool.free([pool.blocks[1]])
    assert pool.free_block_ids() == [0, 1]
    assert refs(pool) == [0, 0]


def test_a_failed_free_changes_nothing(assert_all_blocks_free: AllFree) -> None:
    """A batch with one bad block is refused whole: no block of it is freed."""
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(BlockPoolError, match="block 0 freed twice"):
        pool.free([b, a])
    assert refs(pool) == [0, 1, 0]
    assert pool.free_block_ids() == [2, 0]
    # The same block twice in one batch needs two references.
    with pytest.raises(BlockPoolError, match="block 1 freed twice"):
        pool.free([b, b])
    assert refs(pool) == [0, 1, 0]
    assert pool.free_block_ids() == [2, 0]
    pool.free([b])
    assert_all_blocks_free(pool)


def test_shared_block_is_free_only_after_its_last_reference(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.touch([a])
    assert a.ref_cnt == 3
    assert pool.free_block_ids() == [1, 2]
    pool.free([a])
    pool.free([a])
    assert a.ref_cnt == 1
    assert pool.free_block_ids() == [1, 2]
    pool.free([a])
    assert a.ref_cnt == 0
    assert pool.free_block_ids() == [1, 2, 0]
    assert_all_blocks_free(pool)


def test_cache_blocks_registers_hashes_and_emits_stored(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:2], [h(10), h(11)])
    assert pool.num_cached_blocks == 2
    assert pool.get_cached_block(h(10)) is blocks[0]
    assert pool.get_cached_block(h(11)) is blocks[1]
    assert pool.get_cached_block(h(12)) is None
    assert blocks[0].block_hash == h(10)
    assert blocks[2].block_hash is None
    assert pool.take_events() == [BlockStored(block_hashes=(h(10), h(11)))]
    assert pool.take_events() == []  # take drains

    pool.cache_blocks([], [])
    assert pool.take_events() == []

    pool.free(reversed(blocks))
    # Freed cached blocks stay findable until evicted.
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.num_cached_blocks == 2
    assert pool.get_cached_block(h(10)) is blocks[0]
    assert_all_blocks_free(pool)


def test_touch_revives_a_cached_free_block(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:2], [h(10), h(11)])
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 0]
    pool.take_events()

    hit = pool.get_cached_block(h(10))
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [3, 2, 1]
    assert pool.num_free_blocks == 3
    assert pool.num_cached_blocks == 2
    assert hit.block_hash == h(10)

    # A revived block is not handed out by allocate; the rest are.
    got = pool.allocate(3)
    assert ids(got) == [3, 2, 1]
    assert pool.take_events() == [BlockRemoved(block_hashes=(h(11),))]
    assert pool.get_cached_block(h(10)) is hit  # still cached, in use
    pool.free(got)
    pool.free([hit])
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.take_events() == []
    assert_all_blocks_free(pool)


def test_eviction_emits_removed_and_drops_the_hash(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks[:3], [h(10), h(11), h(12)])
    pool.take_events()
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 0]

    # Block 3 was never cached: no event.
    assert ids(pool.allocate(1)) == [3]
    assert pool.take_events() == []
    assert pool.num_cached_blocks == 3

    # One allocate evicting two cached blocks: one event, hashes in eviction order.
    got = pool.allocate(2)
    assert ids(got) == [2, 1]
    assert pool.take_events() == [BlockRemoved(block_hashes=(h(12), h(11)))]
    assert pool.num_cached_blocks == 1
    assert pool.get_cached_block(h(12)) is None
    assert pool.get_cached_block(h(11)) is None
    assert pool.get_cached_block(h(10)) is blocks[0]
    assert blocks[2].block_hash is None
    assert blocks[1].block_hash is None

    # An evicted block can be cached again under a new hash.
    pool.cache_blocks([blocks[2]], [h(20)])
    assert pool.take_events() == [BlockStored(block_hashes=(h(20),))]
    assert pool.get_cached_block(h(20)) is blocks[2]

    pool.free(got)
    pool.free([blocks[3]])
    assert pool.free_block_ids() == [0, 2, 1, 3]
    assert_all_blocks_free(pool)


def test_cache_blocks_with_a_duplicate_hash_keeps_the_first(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(4)
    first, second, third = pool.allocate(3)
    pool.cache_blocks([first], [h(10)])
    pool.cache_blocks([second, third], [h(10), h(11)])  # same prefix computed twice
    assert pool.get_cached_block(h(10)) is first
    assert second.block_hash is None
    assert pool.get_cached_block(h(11)) is third
    assert pool.num_cached_blocks == 2
    assert pool.take_events() == [
        BlockStored(block_hashes=(h(10),)),
        BlockStored(block_hashes=(h(11),)),
    ]

    # A block that already carries a hash is not re-registered under another one.
    pool.cache_blocks([first], [h(99)])
    assert first.block_hash == h(10)
    assert pool.get_cached_block(h(99)) is None
    assert pool.take_events() == []

    # The uncached duplicate goes back to the pool like any other block and evicts silently.
    pool.free([second])
    assert pool.free_block_ids() == [3, 1]
    assert ids(pool.allocate(2)) == [3, 1]
    assert pool.take_events() == []
    pool.free([pool.blocks[3], second, first, third])
    assert pool.num_cached_blocks == 2
    assert_all_blocks_free(pool)


def test_cache_blocks_length_mismatch_changes_nothing(assert_all_blocks_free: AllFree) -> None:
    """A cached hash always has a BlockStored event: a bad call caches nothing instead of half."""
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.cache_blocks(blocks, [h(10)])
    assert pool.num_cached_blocks == 0
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.take_events() == []
    pool.free(blocks)
    assert_all_blocks_free(pool)


def test_reset_prefix_cache_is_refused_while_blocks_are_used(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [h(10), h(11)])
    pool.take_events()
    pool.free([blocks[1]])

    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    assert blocks[1].block_hash == h(11)
    assert pool.take_events() == []

    pool.free([blocks[0]])
    assert pool.free_block_ids() == [2, 1, 0]
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(h(10)) is None
    assert pool.get_cached_block(h(11)) is None
    assert [b.block_hash for b in pool.blocks] == [None, None, None]
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.free_block_ids() == [2, 1, 0]  # order kept

    # Reused blocks are no longer evictions: no BlockRemoved.
    got = pool.allocate(3)
    assert ids(got) == [2, 1, 0]
    assert pool.take_events() == []
    pool.free(got)
    assert_all_blocks_free(pool)


def test_caching_disabled_caches_nothing(assert_all_blocks_free: AllFree) -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [h(10), h(11)])
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(h(10)) is None
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.take_events() == []
    pool.free(reversed(blocks))
    assert ids(pool.allocate(3)) == [2, 1, 0]
    assert pool.take_events() == []
    pool.free(pool.blocks)
    assert_all_blocks_free(pool)
