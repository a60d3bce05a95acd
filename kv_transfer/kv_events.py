"""KV cache events a worker publishes so the router's prefix index can follow its cache (vLLM's KV events).

Pure dataclasses, no torch. The engine's block pool emits them; the worker's publisher ships them to the Redis
prefix index (worker/kv_event_publisher.py, kv_transfer/prefix_index.py).

Tiers: a block is held on the device (the prefix cache in the KV cache) or in a KV offload tier below it (`disk`,
`host`: engine/core/kv_tier.py). `BlockStored` says where the blocks are now: a block the device evicts into the
tier is stored again with the tier's name (it stays held, its tier changes), and one loaded back from the tier is
stored again on the device. `BlockRemoved` means the worker holds the block nowhere any more.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.block_hash import BlockHash

DEVICE = "device"  # the tier of a block in the device's prefix cache
LOWER_TIERS = ("host", "disk")  # a KV offload tier's kinds (engine/kv_tier_blocks.py), nearest first


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Blocks became reusable prefix cache, or moved to another tier (`tier`: where they are now). `block_hashes`
    are in chain order."""

    block_hashes: tuple[BlockHash, ...]
    tier: str = DEVICE


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for reuse) and, with a tier below it, that tier too."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
