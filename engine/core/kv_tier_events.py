"""The KV events of an engine with a tier below its device cache: what the prefix index hears is the union of the
two, the blocks this worker can serve without computing them, each under the tier it is on now. No torch.

    device cache   stored h ─┐
                   removed h ─┼─▶ for each hash touched: now = "device" if on the device, else the tier's kind
    tier           removed h ─┘       ("disk" | "host") if in the tier, else nowhere
                                      now ≠ announced, held      → BlockStored(tier=now)
                                      announced, held nowhere    → BlockRemoved

So a block the device evicts into the tier stays held and is stored again under the tier's kind (its device
BlockRemoved becomes a move); one loaded back onto the device is stored again under "device"; it is removed when it
leaves both. The device comes first: a block on the device and still in the tier (loaded back, not dropped) is a
device block, because that is where a peer fetch can send it from and where a prompt finds it without a load.

A restarted worker's tier is announced whole by the publisher's first snapshot (`LLMEngine.cached_blocks`), under
its new incarnation, and `announced` starts from it (every block in the tier).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kv_transfer.block_hash import BlockHash
from kv_transfer.kv_events import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class TieredEvents:
    """Turns the device cache's events and the tier's removals into the union's events, with tiers.
    `on_device(h)`: is h in the device's prefix cache now; `in_tier(h)`: is h in the tier (or being written to it)
    now; `tier`: the tier's kind. `announced`: what the index has been told, hash -> tier (what a snapshot lists)."""

    def __init__(self, on_device: Callable[[BlockHash], bool], in_tier: Callable[[BlockHash], bool], *, tier: str,
                 announced: Iterable[BlockHash] = ()) -> None:
        """`announced`: the tier's blocks at start (a restarted worker's, announced by its first snapshot)."""
        self._on_device = on_device
        self._in_tier = in_tier
        self.tier = tier
        self.announced: dict[BlockHash, str] = dict.fromkeys(announced, tier)

    def merge(self, device_events: Sequence[KVEvent], tier_removed: Sequence[BlockHash]) -> list[KVEvent]:
        """The union's events for one batch: the device's, then the tier's removals, in order."""
        out: list[KVEvent] = []
        touched: dict[BlockHash, None] = {}  # ordered set
        for event in device_events:
            if isinstance(event, AllBlocksCleared):
                out.extend(self._settle(touched))
                touched.clear()
                self.announced.clear()
                out.append(event)
            else:
                touched.update(dict.fromkeys(event.block_hashes))
        touched.update(dict.fromkeys(tier_removed))
        out.extend(self._settle(touched))
        return out

    def where(self, block_hash: BlockHash) -> str | None:
        """The tier the block is on now (the device first), None when it is held nowhere."""
        if self._on_device(block_hash):
            return DEVICE
        if self._in_tier(block_hash):
            return self.tier
        return None

    def _settle(self, touched: Iterable[BlockHash]) -> list[KVEvent]:
        removed: list[BlockHash] = []
        stored: dict[str, list[BlockHash]] = {}  # tier -> hashes, in the order touched
        for block_hash in touched:
            now = self.where(block_hash)
            before = self.announced.get(block_hash)
            if now is None:
                if before is not None:
                    del self.announced[block_hash]
                    removed.append(block_hash)
            elif now != before:
                self.announced[block_hash] = now
                stored.setdefault(now, []).append(block_hash)
        events: list[KVEvent] = []
        if removed:
            events.append(BlockRemoved(block_hashes=tuple(removed)))
        events.extend(BlockStored(block_hashes=tuple(hashes), tier=tier) for tier, hashes in stored.items())
        return events
