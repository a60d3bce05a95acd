"""KV cache events a worker publishes so the router's prefix index can follow its cache (vLLM's KV events).

Pure dataclasses, no torch. The engine's block pool emits them; a publisher (a later issue) ships them to Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.block_hash import BlockHash


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Blocks became reusable prefix cache. `block_hashes` are in chain order."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for reuse)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
