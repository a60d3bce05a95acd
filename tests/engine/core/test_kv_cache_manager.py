"""KVCacheManager on exact state: block tables, prefix hits, hit accounting, allocate_slots, cache_blocks, free."""

from __future__ import annotations

from collections.abc import Callable

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.request.sampling_params import SamplingParams
from kv_transfer.block_hash import BlockHashNamespace, hash_token_blocks
from kv_transfer.kv_events import BlockRemoved, BlockStored
from kv_transfer.layout import cdiv

AllFree = Callable[[BlockPool], None]

B = 4
NS = BlockHashNamespace(model="test-model", block_size=B, kv_dtype="float16")


def make_request(request_id: str, prompt: list[int], *, namespace: BlockHashNamespace | None = NS) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(),
        eos_token_ids=(0,),
        max_tokens=16,
        hash_namespace=namespace,
    )


def make_manager(num_blocks: int, *, prefix_caching: bool = True) -> tuple[KVCacheManager, BlockPool]:
    pool = BlockPool(num_blocks)
    return KVCacheManager(pool, block_size=B, enable_prefix_caching=prefix_caching), pool


def compute(manager: KVCacheManager, request: Request, num_new_tokens: int) -> None:
    """What the scheduler does for one step of `request`: allocate, compute, cache."""
    assert manager.allocate_slots(request, num_new_tokens)
    request.num_computed_tokens += num_new_tokens
    manager.cache_blocks(request)


def admit(manager: KVCacheManager, request: Request) -> int:
    """Admit a waiting request the scheduler's way (prefix hits, then the rest); return its hit tokens."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return num_hit_tokens


PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] and a partial [108, 109]


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_slots_builds_an_append_only_table(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(8)
    a = make_request("a", PROMPT)
    assert manager.block_ids("a") == []
    assert manager.allocate_slots(a, 6)
    assert manager.block_ids("a") == [0, 1]
    assert manager.num_requests == 1
    a.num_computed_tokens = 6
    assert manager.allocate_slots(a, 2)  # tokens [6, 8) fit in block 1
    assert manager.block_ids("a") == [0, 1]
    a.num_computed_tokens = 8
    assert manager.allocate_slots(a, 2)
    assert manager.block_ids("a") == [0, 1, 2]
    a.num_computed_tokens = 10
    a.append_output_token(7)
    assert manager.allocate_slots(a, 1)
    assert manager.block_ids("a") == [0, 1, 2]
    a.num_computed_tokens = 11
    a.append_output_token(7)
    a.append_output_token(7)
    assert manager.allocate_slots(a, 2)  # tokens [11, 13): crosses into block 3
    assert manager.block_ids("a") == [0, 1, 2, 3]
    assert pool.free_block_ids() == [4, 5, 6, 7]

    manager.free(a)
    assert manager.num_requests == 0
    assert manager.block_ids("a") == []
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]  # tail first
    assert_all_blocks_free(pool)


def test_free_is_idempotent_and_fine_for_unknown_requests(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(4)
    a = make_request("a", PROMPT)
    compute(manager, a, 10)
    manager.free(a)
    manager.free(a)
    manager.free(make_request("never-seen", PROMPT))
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert_all_blocks_free(pool)


def test_cache_blocks_registers_only_full_computed_blocks(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(8)
    a = make_request("a", PROMPT)
    hashes = hash_token_blocks(NS, PROMPT)
    assert a.block_hashes == hashes and len(hashes) == 2

    assert manager.allocate_slots(a, 3)
    manager.cache_blocks(a)  # nothing computed yet
    assert pool.num_cached_blocks == 0
    a.num_computed_tokens = 3
    manager.cache_blocks(a)  # block 0 allocated but not full of computed tokens
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == []

    compute(manager, a, 3)  # computed 6: block 0 full
    assert pool.num_cached_blocks == 1
    assert pool.get_cached_block(hashes[0]) is pool.blocks[0]
    assert pool.take_events() == [BlockStored(block_hashes=(hashes[0],))]

    compute(manager, a, 4)  # computed 10: block 1 full, block 2 partial
    assert manager.block_ids("a") == [0, 1, 2]
    assert pool.num_cached_blocks == 2
    assert pool.get_cached_block(hashes[1]) is pool.blocks[1]
    assert pool.blocks[2].block_hash is None
    assert pool.take_events() == [BlockStored(block_hashes=(hashes[1],))]

    manager.cache_blocks(a)  # nothing new: no repeated event
    assert pool.take_events() == []

    # Two sampled tokens fill block 2 with tokens, but only one of them is computed yet.
    a.append_output_token(1)
    a.append_output_token(2)
    assert len(a.block_hashes) == 3
    compute(manager, a, 1)  # computed 11 of 12
    assert pool.num_cached_blocks == 2
    assert pool.take_events() == []
    compute(manager, a, 1)  # computed 12
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(a.block_hashes[2]) is pool.blocks[2]
    assert pool.take_events() == [BlockStored(block_hashes=(a.block_hashes[2],))]

    manager.free(a)
    assert pool.num_cached_blocks == 3
    assert_all_blocks_free(pool)


def test_cache_blocks_can_register_several_blocks_at_once(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(4)
    a = make_request("a", list(range(13)))
    compute(manager, a, 13)
    assert pool.take_events() == [BlockStored(block_hashes=tuple(a.block_hashes))]
    assert len(a.block_hashes) == 3
    manager.free(a)
    assert_all_blocks_free(pool)


def test_prefix_hit_returns_the_longest_cached_chain(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(16)
    a = make_request("a", PROMPT)
    compute(manager, a, 10)
    assert manager.block_ids("a") == [0, 1, 2]
    assert pool.num_cached_blocks == 2

    # Same two full blocks, a different tail: both blocks hit.
    b = make_request("b", PROMPT[:8] + [7, 7, 7])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit_tokens == 8

    # Same first block only.
    c = make_request("c", PROMPT[:4] + [7, 7, 7, 7, 7])
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [0]
    assert num_hit_tokens == 4

    # Block 1's tokens equal, block 0's not: chaining means no hit at all.
    d = make_request("d", [7, 7, 7, 7] + PROMPT[4:])
    assert manager.get_computed_blocks(d) == ([], 0)

    # Lookup alone takes no reference.
    assert [blk.ref_cnt for blk in pool.blocks[:3]] == [1, 1, 1]
    manager.free(a)
    assert_all_blocks_free(pool)


def test_prefix_hit_always_leaves_one_token_to_compute(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(16)
    a = make_request("a", list(range(100, 112)))  # exactly 3 blocks
    compute(manager, a, 12)
    assert pool.num_cached_blocks == 3

    same = make_request("same", list(range(100, 112)))
    hits, num_hit_tokens = manager.get_computed_blocks(same)
    assert [blk.block_id for blk in hits] == [0, 1]  # k - 1 blocks
    assert num_hit_tokens == 8

    one_more = make_request("one-more", list(range(100, 113)))
    hits, num_hit_tokens = manager.get_computed_blocks(one_more)
    assert [blk.block_id for blk in hits] == [0, 1, 2]
    assert num_hit_tokens == 12

    single = make_request("single", list(range(100, 104)))  # one block, fully cached
    assert manager.get_computed_blocks(single) == ([], 0)
    manager.free(a)
    assert_all_blocks_free(pool)


def test_hit_accounting(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(16)
    assert (manager.prefix_queries_tokens, manager.prefix_hits_tokens) == (0, 0)
    a = make_request("a", PROMPT)
    assert admit(manager, a) == 0
    assert (manager.prefix_queries_tokens, manager.prefix_hits_tokens) == (10, 0)

    b = make_request("b", PROMPT + [1, 2])  # 12 tokens, 8 cached
    assert admit(manager, b) == 8
    assert (manager.prefix_queries_tokens, manager.prefix_hits_tokens) == (22, 8)

    c = make_request("c", PROMPT[:4])  # 4 tokens: the only block cannot be a hit
    assert admit(manager, c) == 0
    assert (manager.prefix_queries_tokens, manager.prefix_hits_tokens) == (26, 8)

    for r in (a, b, c):
        manager.free(r)
    assert_all_blocks_free(pool)


def test_prefix_caching_disabled(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(8, prefix_caching=False)
    a = make_request("a", PROMPT)
    compute(manager, a, 10)
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == []
    b = make_request("b", PROMPT)
    assert manager.get_computed_blocks(b) == ([], 0)
    assert (manager.prefix_queries_tokens, manager.prefix_hits_tokens) == (0, 0)
    manager.free(a)
    assert_all_blocks_free(pool)


def test_request_without_namespace_never_hits(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(8)
    a = make_request("a", PROMPT, namespace=None)
    assert a.block_hashes == []
    compute(manager, a, 10)
    assert pool.num_cached_blocks == 0
    b = make_request("b", PROMPT, namespace=None)
    assert manager.get_computed_blocks(b) == ([], 0)
    manager.free(a)
    assert_all_blocks_free(pool)


def test_shared_prefix_blocks_are_ref_counted(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(8)
    a = make_request("a", PROMPT)
    compute(manager, a, 10)  # [0, 1, 2]
    pool.take_events()

    b = make_request("b", PROMPT[:8] + [5])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, b.num_tokens - num_hit_tokens, hits)
    assert manager.block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in pool.blocks] == [2, 2, 1, 1, 0, 0, 0, 0]
    b.num_computed_tokens = 9
    manager.cache_blocks(b)  # hits are already cached: nothing new
    assert pool.take_events() == []

    manager.free(a)  # the shared head stays with b; only a's tail is free
    assert pool.free_block_ids() == [4, 5, 6, 7, 2]
    assert [blk.ref_cnt for blk in pool.blocks] == [1, 1, 0, 1, 0, 0, 0, 0]
    manager.free(b)
    assert pool.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert_all_blocks_free(pool)


def test_allocate_slots_fails_without_side_effects(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(4)
    a = make_request("a", PROMPT)
    compute(manager, a, 10)  # [0, 1, 2]
    pool.take_events()

    # A new request that needs 2 blocks with 1 free: no table left behind.
    b = make_request("b", [1, 2, 3, 4, 5])
    assert not manager.allocate_slots(b, 5)
    assert manager.block_ids("b") == []
    assert manager.num_requests == 1
    assert pool.free_block_ids() == [3]

    # A running request that needs 2 more blocks with 1 free: its table is untouched.
    for t in range(7):
        a.append_output_token(t)
    assert not manager.allocate_slots(a, 7)  # tokens [10, 17) would need blocks 3 and 4
    assert manager.block_ids("a") == [0, 1, 2]
    assert pool.free_block_ids() == [3]
    assert [blk.ref_cnt for blk in pool.blocks] == [1, 1, 1, 0]
    assert pool.take_events() == []

    # Exactly enough is enough: tokens [10, 16) need block 3 only.
    assert manager.allocate_slots(a, 6)
    assert manager.block_ids("a") == [0, 1, 2, 3]
    manager.free(a)
    assert_all_blocks_free(pool)


def test_allocate_slots_counts_revived_cached_blocks(assert_all_blocks_free: AllFree) -> None:
    """Hits on free cached blocks take those blocks off the free list too: they count against the pool."""
    manager, pool = make_manager(4)
    a = make_request("a", PROMPT)
    compute(manager, a, 10)  # [0, 1, 2], blocks 0 and 1 cached
    manager.free(a)
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.take_events() == [BlockStored(block_hashes=tuple(a.block_hashes))]

    # 17 tokens: 2 hit blocks (both free) + 3 new = 5 > 4 blocks. Fails with nothing changed.
    b = make_request("b", PROMPT[:8] + list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit_tokens == 8
    assert not manager.allocate_slots(b, b.num_tokens - num_hit_tokens, hits)
    assert manager.block_ids("b") == []
    assert manager.num_requests == 0
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert [blk.ref_cnt for blk in pool.blocks] == [0, 0, 0, 0]
    assert pool.num_cached_blocks == 2
    assert pool.take_events() == []

    # 16 tokens: 2 revived + 2 new = 4 blocks. Succeeds; the new ones come from the front, uncached.
    c = make_request("c", PROMPT[:8] + list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert manager.allocate_slots(c, c.num_tokens - num_hit_tokens, hits)
    assert manager.block_ids("c") == [0, 1, 3, 2]
    assert pool.free_block_ids() == []
    assert [blk.ref_cnt for blk in pool.blocks] == [1, 1, 1, 1]
    assert pool.take_events() == []  # blocks 3 and 2 held no cache
    c.num_computed_tokens = 16
    manager.cache_blocks(c)  # blocks 0, 1 were hits; blocks 3 (tokens 8..11) and 2 (12..15) are new cache
    assert pool.take_events() == [BlockStored(block_hashes=tuple(c.block_hashes[2:]))]
    manager.free(c)
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert_all_blocks_free(pool)


def test_allocation_evicts_cached_blocks_from_the_lru_end(assert_all_blocks_free: AllFree) -> None:
    manager, pool = make_manager(3)
    a = make_request("a", list(range(100, 109)))  # 9 tokens: 2 cached blocks + 1 partial
    compute(manager, a, 9)
    manager.free(a)
    assert pool.free_block_ids() == [2, 1, 0]
    pool.take_events()

    b = make_request("b", [7] * 8)
    admit(manager, b)
    assert manager.block_ids("b") == [2, 1]  # block 2 was uncached; block 1 held a's tail
    assert pool.take_events() == [
        BlockRemoved(block_hashes=(a.block_hashes[1],)),
        BlockStored(block_hashes=tuple(b.block_hashes)),
    ]
    # a's head is still cached and still hits.
    a2 = make_request("a2", list(range(100, 109)))
    hits, num_hit_tokens = manager.get_computed_blocks(a2)
    assert [blk.block_id for blk in hits] == [0]
    assert num_hit_tokens == 4
    manager.free(b)
    assert_all_blocks_free(pool)


def test_block_ids_follow_the_table_through_every_change(assert_all_blocks_free: AllFree) -> None:
    """`block_ids` (kept beside the tables, not rebuilt from them) is each table's ids after every kind of change:
    prefix hits, growth, a refused allocation, a fork, a freed tail, a free; and a copy the caller may keep."""
    manager, pool = make_manager(12)

    def table_ids(request_id: str) -> list[int]:
        return [b.block_id for b in manager._tables.get(request_id, [])]

    first = make_request("a", PROMPT)
    admit(manager, first)
    second = make_request("b", PROMPT + [7, 7])
    assert admit(manager, second) == 8  # two prefix hits, then a block of its own
    for request in (first, second):
        assert manager.block_ids(request.request_id) == table_ids(request.request_id)
    kept = manager.block_ids("b")
    compute(manager, second, 7)  # grows by two blocks
    assert manager.block_ids("b") == table_ids("b") and kept != manager.block_ids("b")
    assert not manager.allocate_slots(make_request("c", list(range(60))), 60)  # refused: no table, no ids
    assert manager.block_ids("c") == [] and "c" not in manager._tables
    child = make_request("b-1", PROMPT + [7, 7])
    manager.fork(second, child, 2)
    assert manager.block_ids("b-1") == table_ids("b-1") == manager.block_ids("b")[:2]
    assert manager.allocate_slots(second, 6)  # slots for six drafts, then only two of them computed
    second.num_computed_tokens += 2
    assert manager.free_uncomputed_tail(second) == 1
    assert manager.block_ids("b") == table_ids("b")
    for request in (first, second, child):
        manager.free(request)
        assert manager.block_ids(request.request_id) == []
    assert not manager._ids
    assert_all_blocks_free(pool)
