"""The gateway's side of the Redis prefix index (`kv_transfer/prefix_index.py` owns the schema): look a prompt
up in one round trip, record a routing decision as provisional entries, read stats for operators.

    client = PrefixIndexClient(redis_url)      no I/O
    await client.start()                       a background task pings Redis every `ping_interval_s` (`up`)
    await client.lookup(namespace, hashes)     {(worker_id, incarnation): leading blocks held, by tier}, None
                                               while down
    await client.record(namespace, worker, hashes)     provisional entries, short TTL
    await client.worker_stats(namespace)       blocks indexed per worker and tier (/v1/prefix_index), kept as
                                               `last_worker_stats` for /metrics (`refresh_stats` never raises)
    await client.close()

The index is an optimisation: every call here is bounded by `timeout_s` and never raises into routing; while
Redis is unreachable the client answers None at once (no per-request connection timeouts) and routing falls back
to load. The client keeps no routing state: everything a second gateway replica needs is in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kv_transfer import prefix_index as pi
from kv_transfer.block_hash import BlockHash, BlockHashNamespace
from kv_transfer.kv_events import DEVICE

logger = logging.getLogger(__name__)


@dataclass
class IndexCounters:
    """For /metrics: lookups by outcome, their latency, and predictions checked against the workers' hits."""

    lookups: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0, "down": 0})
    lookup_seconds: list[float] = field(default_factory=list)  # drained by the metrics collector
    predictions: dict[str, int] = field(default_factory=lambda: {"match": 0, "mismatch": 0})


@dataclass(frozen=True, kw_only=True)
class WorkerIndexStats:
    worker_id: str
    incarnation: int
    role: str
    seq: int
    num_blocks: int  # held, on any tier
    num_blocks_by_tier: dict[str, int] = field(default_factory=dict)  # "device" and each lower tier; sums to it


class PrefixIndexClient:
    def __init__(self, redis_url: str, *, timeout_s: float = 0.5, ping_interval_s: float = 1.0,
                 on_state: Callable[[bool], None] | None = None) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, asyncio.TimeoutError)
        self._timeout_s = timeout_s
        self._ping_interval_s = ping_interval_s
        self._lookup = self._redis.register_script(pi.LOOKUP)
        self._provisional = self._redis.register_script(pi.PROVISIONAL)
        self._purge = self._redis.register_script(pi.PURGE)
        self._on_state = on_state or (lambda up: None)
        self.up = False
        self.counters = IndexCounters()
        self.last_worker_stats: list[WorkerIndexStats] = []  # the last `worker_stats` answer ([] after a failure)
        self._task: asyncio.Task[None] | None = None
        self.redis_url = redis_url

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._ping()
        self._task = asyncio.create_task(self._ping_forever(), name="prefix-index-ping")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(*self._errors):
            await self._redis.aclose()

    async def _ping_forever(self) -> None:
        while True:
            await asyncio.sleep(self._ping_interval_s)
            await self._ping()

    async def _ping(self) -> None:
        try:
            await asyncio.wait_for(self._redis.ping(), self._timeout_s)
        except self._errors as exc:
            self._set_up(False, exc)
        else:
            self._set_up(True)

    def _set_up(self, up: bool, exc: BaseException | None = None) -> None:
        if up != self.up:
            if up:
                logger.info("prefix index: Redis is reachable; routing by cached prefix")
            else:
                logger.warning("prefix index: Redis unreachable (%s); routing by load only", exc)
        self.up = up
        self._on_state(up)

    # -- calls -----------------------------------------------------------------------------------------------
    async def lookup(self, namespace: BlockHashNamespace,
                     block_hashes: Sequence[BlockHash]) -> dict[tuple[str, int], pi.HeldPrefix] | None:
        """Per (worker, incarnation), the leading blocks of `block_hashes` it holds (confirmed or provisional) and
        the tiers they are on; None while the index is down or the call fails."""
        if not self.up:
            self.counters.lookups["down"] += 1
            return None
        if not block_hashes:
            return {}
        start_s = time.perf_counter()
        try:
            reply = await asyncio.wait_for(
                self._lookup(args=pi.lookup_args(pi.key_prefix(namespace), block_hashes)), self._timeout_s)
        except self._errors as exc:
            self.counters.lookups["error"] += 1
            self._set_up(False, exc)
            return None
        self.counters.lookups["ok"] += 1
        self.counters.lookup_seconds.append(time.perf_counter() - start_s)
        return pi.parse_held(reply)

    async def record(self, namespace: BlockHashNamespace, worker_id: str, incarnation: int,
                     block_hashes: Sequence[BlockHash], ttl_s: float = pi.PROVISIONAL_TTL_S) -> None:
        """Mark `block_hashes` provisionally held by the worker a request was just routed to."""
        if not self.up or not block_hashes:
            return
        args = pi.provisional_args(pi.key_prefix(namespace), worker_id, incarnation, block_hashes, ttl_s)
        try:
            await asyncio.wait_for(self._provisional(args=args), self._timeout_s)
        except self._errors as exc:
            self._set_up(False, exc)

    async def worker_stats(self, namespace: BlockHashNamespace) -> list[WorkerIndexStats]:
        """Blocks indexed per worker and incarnation, and per tier (raises when Redis is unreachable). Kept as
        `last_worker_stats`."""
        prefix = pi.key_prefix(namespace)
        workers = pi.parse_workers(await self._redis.hgetall(pi.workers_key(prefix)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in workers:
                pipe.scard(pi.worker_blocks_key(prefix, worker_id))
                pipe.hgetall(pi.worker_tier_counts_key(prefix, worker_id))
            replies = await pipe.execute()
        stats = []
        for i, (wid, (inc, role, seq)) in enumerate(workers.items()):
            num_blocks = int(replies[2 * i])
            below = {_text(tier): int(n) for tier, n in replies[2 * i + 1].items() if int(n) > 0}
            by_tier = {DEVICE: num_blocks - sum(below.values()), **dict(sorted(below.items()))}
            stats.append(WorkerIndexStats(worker_id=wid, incarnation=inc, role=role, seq=seq, num_blocks=num_blocks,
                                          num_blocks_by_tier=by_tier))
        self.last_worker_stats = stats
        return stats

    async def refresh_stats(self, namespace: BlockHashNamespace | None) -> None:
        """`worker_stats` for a scrape, bounded by the client's timeout: never raises; nothing known ([]) while
        Redis is down or no namespace is known yet."""
        if namespace is None or not self.up:
            self.last_worker_stats = []
            return
        try:
            await asyncio.wait_for(self.worker_stats(namespace), self._timeout_s)
        except self._errors as exc:
            self.last_worker_stats = []
            self._set_up(False, exc)

    async def purge(self, namespace: BlockHashNamespace, worker_id: str) -> int:
        return int(await self._purge(args=[pi.key_prefix(namespace), worker_id]))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
