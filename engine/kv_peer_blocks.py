"""Blocks fetched from a peer worker, staged until the request they were fetched for is admitted, and the chain of
tiers below the device cache that the KV cache manager looks them up in.

    worker/peer_fetch.py fetches blocks s..n of a prompt from the worker holding them, into a host staging
    tensor (checked: CRC-32C per block) ──▶ engine.stage_peer_blocks(hashes, kv, scales) ──▶ PeerBlocks
    scheduler admits the prompt ──▶ TierChain: peer blocks first, then the offload tier (--kv-offload-dir)
                                 ──▶ load(b, h): the staged block copied into device block b (a "peer" prefix hit)
    the request ends ──▶ engine.unstage_peer_blocks(hashes)
    the copies in the device cache, once freed ──▶ the front of the free list (evicted before the worker's own)

Staged blocks are no cache of their own: they are never announced to the prefix index (the blocks the admission
copies into the device cache are, as any computed block), never evicted into a tier, and they go when the fetching
request ends. Everything here runs under the engine's lock: on its thread, or on a worker's thread while a step
computes (a fetch staging its blocks: worker/engine_loop.py's `call_now`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.kv_cache_manager import LowerTier
from kv_transfer.block_hash import BlockHash
from kv_transfer.whole_blocks import WholeBlocks


@dataclass(frozen=True)
class _Staged:
    kv: torch.Tensor  # [num_layers, 2, block_size, num_kv_heads, head_dim], the cache's dtype
    scales: torch.Tensor | None  # int8 cache: [num_layers, 2, num_kv_heads]
    refs: int


class PeerBlocks:
    """A `LowerTier` of staged peer blocks over one KV cache, each staged once per fetch that brought it."""

    kind = "peer"

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, *,
                 whole: WholeBlocks | None = None) -> None:
        """`whole`: at tensor_parallel_size > 1, every rank's cache: blocks are staged whole (every KV head, as the
        holder sent them for a receiver of size 1) and each rank's heads loaded into its cache."""
        self._kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self._kv_scales = kv_scales
        self._whole = whole
        self.loads_every_rank = whole is not None  # at TP > 1: whether staged blocks reach every rank's cache
        self._staged: dict[BlockHash, _Staged] = {}

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._staged

    def __len__(self) -> int:
        return len(self._staged)

    def stage(self, block_hashes: Sequence[BlockHash], kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Stage block i of `kv` ([num_layers, 2, k, block_size, heads, head_dim]; `scales` [num_layers, 2, k,
        heads] for an int8 cache) under `block_hashes[i]`. A hash staged already keeps its first copy (the same
        tokens in the same namespace: the same KV) and one more reference."""
        if kv.shape[2] != len(block_hashes):
            raise ValueError(f"{len(block_hashes)} hashes for {kv.shape[2]} staged blocks")
        for i, block_hash in enumerate(block_hashes):
            old = self._staged.get(block_hash)
            if old is not None:
                self._staged[block_hash] = _Staged(old.kv, old.scales, old.refs + 1)
                continue
            self._staged[block_hash] = _Staged(kv[:, :, i], None if scales is None else scales[:, :, i], 1)

    def unstage(self, block_hashes: Sequence[BlockHash]) -> None:
        """Drop one reference of each hash `stage` took; a hash with none left goes."""
        for block_hash in block_hashes:
            old = self._staged.get(block_hash)
            if old is None:
                continue
            if old.refs <= 1:
                del self._staged[block_hash]
            else:
                self._staged[block_hash] = _Staged(old.kv, old.scales, old.refs - 1)

    def load(self, block_id: int, block_hash: BlockHash) -> bool:
        staged = self._staged.get(block_hash)
        if staged is None:
            return False
        if self._whole is not None:
            self._whole.write(block_id, staged.kv, staged.scales)
            return True
        self._kv_cache[:, :, block_id].copy_(staged.kv)
        if self._kv_scales is not None and staged.scales is not None:
            self._kv_scales[:, :, block_id].copy_(staged.scales)
        return True


class TierChain:
    """The tiers below the device cache as one `LowerTier`, looked up in order; counts the blocks each loaded.
    `load` answers with the kind of the tier that loaded the block ("" when none did): a block loaded from a kind in
    `evict_first_kinds` (a peer's, which that peer still holds) is evicted before this worker's own blocks."""

    evict_first_kinds = frozenset({PeerBlocks.kind})

    def __init__(self, tiers: Sequence[LowerTier]) -> None:
        self.tiers = list(tiers)
        self.blocks_loaded: dict[str, int] = {getattr(tier, "kind", "tier"): 0 for tier in self.tiers}

    def __contains__(self, block_hash: BlockHash) -> bool:
        return any(block_hash in tier for tier in self.tiers)

    def load(self, block_id: int, block_hash: BlockHash) -> str:
        for tier in self.tiers:
            if block_hash in tier and tier.load(block_id, block_hash):
                kind = getattr(tier, "kind", "tier")
                self.blocks_loaded[kind] = self.blocks_loaded.get(kind, 0) + 1
                return kind
        return ""

    def without(self, tier: LowerTier) -> TierChain:
        """The chain less `tier` (the offload tier, closed), its counts kept."""
        chain = TierChain([t for t in self.tiers if t is not tier])
        chain.blocks_loaded = dict(self.blocks_loaded)
        return chain
