"""What the dispatcher asks of the prefix index: a prompt's overlaps per live worker, and recording where it went.

    lookup = await prefix.lookup(token_ids)       hash the prompt's full blocks in the workers' namespace, one
                                                  Redis round trip; overlaps of live (worker, incarnation) only,
                                                  with the tiers the blocks are on; None when there is no index,
                                                  no namespace yet, or Redis is down
    prefix.record(lookup, route)                  provisional entries for the worker that will prefill (and the
                                                  decode worker, which receives the prompt's blocks), off the
                                                  request path
    prefix.check_prediction(lookup, route, n)     after the request: did the index predict the worker's prefix hit?

The namespace (model identity, block size, KV dtype) is what the workers report in their load: the router hashes
exactly as they do. Nothing here is state a second gateway replica would need: the provisional entries are in
Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kv_transfer.block_hash import BlockHash, BlockHashNamespace, adapter_root, hash_token_blocks
from kv_transfer.kv_events import DEVICE
from kv_transfer.prefix_index import HeldPrefix
from router.prefix_index_client import PrefixIndexClient
from router.routing import Route

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PrefixLookup:
    """A prompt's overlaps. `overlap` counts a worker's leading blocks held on any tier (what "held" always meant);
    `held` says where those blocks are (a worker missing from it has them all on the device)."""

    namespace: BlockHashNamespace
    block_hashes: list[BlockHash]
    overlap: dict[str, int]  # live worker id -> leading blocks of the prompt it holds
    held: dict[str, HeldPrefix] = field(default_factory=dict)  # live worker id -> those blocks by tier

    @property
    def overlap_by_tier(self) -> dict[str, dict[str, int]]:
        """Live worker id -> {tier: how many of its leading blocks are on it}."""
        return {wid: self.held[wid].by_tier() if wid in self.held else {DEVICE: n} for wid, n in self.overlap.items()}

    @property
    def lower_tier_blocks(self) -> dict[str, dict[str, int]]:
        """Live worker id -> {tier below the device: its leading blocks on it}, workers with any only (routing's
        price of a hit by tier: router/routing.py)."""
        out = {wid: {t: n for t, n in tiers.items() if t != DEVICE} for wid, tiers in self.overlap_by_tier.items()}
        return {wid: tiers for wid, tiers in out.items() if tiers}

    def device_reach(self, worker_id: str, start: int) -> int:
        """The end of the run of the worker's leading blocks on its device from block `start` (`HeldPrefix`): what
        it can send a peer from there (a holder serves device blocks only)."""
        held = self.held.get(worker_id)
        if held is None:
            n = self.overlap.get(worker_id, 0)
            return n if start < n else start
        return held.device_reach(start)


def predicted_cached_tokens(overlap_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """The prefix hit a worker holding `overlap_blocks` leading blocks reports: whole blocks, and never the whole
    prompt (its last token is always computed, to sample the first output token)."""
    return min(overlap_blocks, (num_prompt_tokens - 1) // block_size) * block_size


class PrefixIndex:
    def __init__(
        self,
        client: PrefixIndexClient,
        *,
        namespace: Callable[[], BlockHashNamespace | None],
        live_workers: Callable[[], Mapping[str, int]],
    ) -> None:
        """`namespace()`: the workers' hash namespace (None until one reported it); `live_workers()`: worker id
        -> incarnation of the workers routing may choose."""
        self.client = client
        self._namespace = namespace
        self._live_workers = live_workers
        self._background: set[asyncio.Task[None]] = set()

    async def lookup(self, token_ids: Sequence[int], *, adapter: str | None = None) -> PrefixLookup | None:
        """`adapter`: the digest of the LoRA adapter the prompt runs under (its blocks chain from that root)."""
        namespace = self._namespace()
        if namespace is None:
            return None
        hashes = hash_token_blocks(namespace, token_ids, root=adapter_root(namespace, adapter))
        found = await self.client.lookup(namespace, hashes)
        if found is None:
            return None
        live = self._live_workers()
        held = {wid: prefix for (wid, inc), prefix in found.items() if live.get(wid) == inc}
        return PrefixLookup(namespace=namespace, block_hashes=hashes,
                            overlap={wid: prefix.num_blocks for wid, prefix in held.items()}, held=held)

    def record(self, lookup: PrefixLookup | None, route: Route) -> None:
        """Provisional entries for where the prompt's blocks will be, written in the background."""
        if lookup is None or not lookup.block_hashes:
            return
        workers = {route.prefill_worker.worker_id: route.prefill_worker.incarnation,
                   route.target.worker_id: route.target.incarnation}
        for worker_id, incarnation in workers.items():
            task = asyncio.ensure_future(
                self.client.record(lookup.namespace, worker_id, incarnation, lookup.block_hashes))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def check_prediction(self, lookup: PrefixLookup | None, route: Route, num_prompt_tokens: int,
                         num_cached_tokens: int) -> None:
        """Count whether the index's overlap for the worker that prefilled matched the hit it reported."""
        if lookup is None:
            return
        predicted = predicted_cached_tokens(lookup.overlap.get(route.prefill_worker.worker_id, 0),
                                            num_prompt_tokens, lookup.namespace.block_size)
        self.client.counters.predictions["match" if predicted == num_cached_tokens else "mismatch"] += 1

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.client.close()
