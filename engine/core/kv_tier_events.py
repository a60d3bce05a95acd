"""The KV events of an engine with a tier below its device cache: what the prefix index hears is the union of the
two, the blocks this worker can serve without computing them. No torch.

    device cache   stored h ─┐
                   removed h ─┼─▶ for each hash touched: held = on the device or in the tier
    tier           removed h ─┘       held and not announced  → BlockStored
                                      announced and not held  → BlockRemoved

So a block the device evicts into the tier stays announced (its device BlockRemoved is absorbed), and it is
removed when it leaves both. A restarted worker's tier is announced whole by the publisher's first snapshot
(`LLMEngine.cached_block_hashes`), under its new incarnation, and `announced` starts from it. The events carry
no tier field: the index learns which blocks a worker holds, not where (loading from the tier is the worker's
business, far cheaper than recomputing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kv_transfer.block_hash import BlockHash
from kv_transfer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class TieredEvents:
    """Turns the device cache's events and the tier's removals into the union's events. `held(h)`: is h on the
    device or in the tier, now. `announced`: what the index has been told (the hashes a snapshot would list)."""

    def __init__(self, held: Callable[[BlockHash], bool], announced: Iterable[BlockHash] = ()) -> None:
        self._held = held
        self.announced: set[BlockHash] = set(announced)

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

    def _settle(self, touched: Iterable[BlockHash]) -> list[KVEvent]:
        stored, removed = [], []
        for block_hash in touched:
            held = self._held(block_hash)
            if held and block_hash not in self.announced:
                self.announced.add(block_hash)
                stored.append(block_hash)
            elif not held and block_hash in self.announced:
                self.announced.discard(block_hash)
                removed.append(block_hash)
        events: list[KVEvent] = []
        if removed:
            events.append(BlockRemoved(block_hashes=tuple(removed)))
        if stored:
            events.append(BlockStored(block_hashes=tuple(stored)))
        return events
