"""Fixed-size KV blocks with reference counts, an LRU free list and the hash → block prefix-cache map.

Control plane: block ids only, no tensors. The runtime owns the KV tensors the ids index.

Free-list order is eviction order:

    front (evicted first)                                       back (evicted last)
    [ never-used blocks, in id order ] [ freed blocks, least recently freed first ]

A block marked `evict_first` (a copy fetched from a peer, which the peer still holds) is freed to the front
instead. A freed block keeps its hash and stays findable as prefix cache until `allocate` takes it from the front
of the free list; only then is it evicted (its hash dropped, a `BlockRemoved` event emitted, and `on_evict` called with its
id and hash while its KV is still intact: where a tier below takes a copy, engine/core/kv_tier.py). `touch` revives a cached
free block for a prefix hit. Every block is freed exactly once per reference: a free of an unreferenced block
raises instead of corrupting the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from kv_transfer.block_hash import BlockHash
from kv_transfer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "evict_first")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # A copy another worker also holds (fetched from a peer): when freed it goes to the front of the free list,
        # so that this worker's cache keeps what only it holds and the cluster keeps more distinct prefixes.
        self.evict_first = False

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPoolError(RuntimeError):
    """An allocator invariant was about to break (double free, over-allocation)."""


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        # Called as a cached block is evicted, before `allocate` returns it to be overwritten. None: nobody asks.
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    # -- queries ---------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (some may still hold reusable prefix cache)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (front first)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now (a snapshot for the prefix index)."""
        return list(self._cached)

    # -- allocation ------------------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` from the front of the free list, evicting any prefix cache they hold."""
        if num_blocks > len(self._free):
            raise BlockPoolError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        out = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            block.evict_first = False
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=tuple(evicted)))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix hit); a free cached block leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; unreferenced blocks go to the back of the free list in the
        order given (callers pass a request's blocks tail first, so its tail is evicted before its head).
        A batch holding an unreferenced block is refused whole, before any block of it is freed."""
        block_list = list(blocks)
        num_refs: dict[int, int] = {}
        for block in block_list:
            num_refs[block.block_id] = num_refs.get(block.block_id, 0) + 1
            if num_refs[block.block_id] > block.ref_cnt:
                raise BlockPoolError(f"block {block.block_id} freed twice")
        for block in block_list:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.evict_first:
                    self._free.move_to_end(block.block_id, last=False)

    # -- prefix cache ----------------------------------------------------------------------------------------
    def cache_blocks(self, blocks: Iterable[KVBlock], block_hashes: Iterable[BlockHash]) -> None:
        """Register full, computed blocks as prefix cache under their chained hashes.

        A hash that is already cached keeps its first block (two requests computed the same prefix in one step);
        the duplicate simply stays uncached and returns to the pool when freed.
        """
        if not self.enable_caching:
            return
        block_list, hash_list = list(blocks), list(block_hashes)
        if len(block_list) != len(hash_list):  # checked first: a hash is never cached without its event
            raise ValueError(f"{len(block_list)} blocks but {len(hash_list)} hashes")
        stored: list[BlockHash] = []
        for block, block_hash in zip(block_list, hash_list, strict=True):
            if block.block_hash is not None or block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
        if stored:
            self._events.append(BlockStored(block_hashes=tuple(stored)))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Refused (False) while any block is referenced."""
        if self.num_used_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
