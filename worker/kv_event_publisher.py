"""A worker's KV events, published to the cluster's prefix index in Redis, off the engine's thread.

    engine thread: step → engine.publish_kv_events() → publisher.publish(events)     a queue put, never blocks
    publisher thread: batch (worker id, incarnation, seq) → APPLY (one Lua call) → "ok" | "gap" | "stale"

Lifecycle and resynchronisation:

    start()                 the first thing sent is a snapshot of the (empty or warm) cache as a reset batch: it
                            purges whatever an older incarnation of this worker left in the index
    "gap"                   the index missed a batch of ours (Redis lost its data, or an earlier send failed):
                            ask the engine thread for a snapshot (`request_snapshot`), drop incremental batches
                            until it arrives, send it as a reset batch
    idle                    every `retry_interval_s` without events, check that the index still registers this
                            worker as it last published (Redis restarted empty, the controller purged it): if
                            not, resynchronise the same way
    Redis unreachable       `up` is False; batches are dropped (a snapshot follows recovery); the thread retries
                            every `retry_interval_s`, then resynchronises with a snapshot
    close()                 the thread ends after what is queued (bounded by its timeout)

A snapshot is taken on the engine thread between steps (`offer_snapshot`), so it comes after every batch of
events already queued and before any later one, in the same queue: nothing is lost or applied twice. It lists the
cached blocks by tier (`LLMEngine.cached_blocks`: "device", and a KV offload tier's kind), sent as one
`BlockStored` per tier, so the index knows where each block is from the first batch on.

`NullPublisher` (no index configured) drops events, so that nothing accumulates in a worker without Redis.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kv_transfer import prefix_index as pi
from kv_transfer.block_hash import BlockHash, BlockHashNamespace
from kv_transfer.kv_events import DEVICE, BlockStored, KVEvent

logger = logging.getLogger(__name__)

_MAX_QUEUED_BATCHES = 10_000  # beyond this the index is behind anyway: drop, and resynchronise by snapshot


class NullPublisher:
    """No prefix index: events are dropped."""

    up = False

    def publish(self, events: Sequence[KVEvent]) -> None:
        pass

    def offer_snapshot(self, blocks: Mapping[str, Sequence[BlockHash]] | Sequence[BlockHash]) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _Snapshot:
    events: tuple[BlockStored, ...]  # one per tier
    num_dropped_before: int  # batches dropped (queue full) before it was taken: later drops need another one


def snapshot_events(blocks: Mapping[str, Sequence[BlockHash]] | Sequence[BlockHash]) -> tuple[BlockStored, ...]:
    """A snapshot's batch: one `BlockStored` per tier that holds blocks (a plain sequence: all on the device)."""
    by_tier = blocks if isinstance(blocks, Mapping) else {DEVICE: blocks}
    return tuple(BlockStored(block_hashes=tuple(hashes), tier=tier) for tier, hashes in by_tier.items() if hashes)


@dataclass
class PublisherStats:
    num_batches: int = 0
    num_snapshots: int = 0
    num_gaps: int = 0
    num_dropped: int = 0
    num_errors: int = 0


class RedisKVEventPublisher:
    """Publishes one worker's KV events to the Redis prefix index. `request_snapshot()` must make the engine
    thread call `offer_snapshot(cached blocks by tier)` soon (between steps); it is called from this thread."""

    def __init__(
        self,
        *,
        redis_url: str,
        namespace: BlockHashNamespace,
        publisher: pi.PublisherId,
        request_snapshot: Callable[[], None],
        retry_interval_s: float = 1.0,
        socket_timeout_s: float = 2.0,
    ) -> None:
        import redis  # the client only; a worker without an index never imports it

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=socket_timeout_s,
                                           socket_connect_timeout=socket_timeout_s)
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self._apply = self._redis.register_script(pi.APPLY)
        self._prefix = pi.key_prefix(namespace)
        self._namespace = namespace
        self._publisher = publisher
        self._request_snapshot = request_snapshot
        self._retry_interval_s = retry_interval_s
        self._queue: queue.Queue[tuple[KVEvent, ...] | _Snapshot | None] = queue.Queue()
        self._seq = 0
        self._num_overflows = 0  # batches the engine thread dropped on a full queue (written there only)
        self._num_overflows_seen = 0
        self._needs_snapshot = True  # the first batch replaces whatever an older incarnation left
        self._snapshot_asked = False
        self._retired = False  # a newer incarnation of this worker id took over: publish nothing more
        self.up = False
        self.stats = PublisherStats()
        self._thread = threading.Thread(target=self._run, name=f"{publisher.worker_id}-kv-events", daemon=True)

    # -- engine thread ---------------------------------------------------------------------------------------
    def publish(self, events: Sequence[KVEvent]) -> None:
        if events:
            self._put(tuple(events))

    def offer_snapshot(self, blocks: Mapping[str, Sequence[BlockHash]] | Sequence[BlockHash]) -> None:
        """`blocks`: tier -> the hashes cached on it (a plain sequence: all on the device)."""
        self._queue.put(_Snapshot(snapshot_events(blocks), self._num_overflows))  # never dropped

    def _put(self, item: tuple[KVEvent, ...]) -> None:
        if self._queue.qsize() >= _MAX_QUEUED_BATCHES:  # the index is far behind: resynchronise instead
            self._num_overflows += 1
            return
        self._queue.put(item)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._redis.close()

    # -- publisher thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._needs_snapshot and not self._snapshot_asked and not self._retired and self._connect():
                self._snapshot_asked = True
                self._request_snapshot()
            try:
                item = self._queue.get(timeout=self._retry_interval_s)
            except queue.Empty:
                self._verify()
                continue
            if item is None:
                return
            if self._retired:
                continue
            if self._num_overflows != self._num_overflows_seen:
                self.stats.num_dropped += self._num_overflows - self._num_overflows_seen
                self._num_overflows_seen = self._num_overflows
                self._needs_snapshot = True
            if isinstance(item, _Snapshot):
                self._send(pi.EventBatch(publisher=self._publisher, seq=self._next_seq(), reset=True,
                                         events=item.events),
                           snapshot_dropped_before=item.num_dropped_before)
            elif self._needs_snapshot:
                self.stats.num_dropped += 1  # the snapshot on its way covers it
            else:
                self._send(pi.EventBatch(publisher=self._publisher, seq=self._next_seq(), events=item))

    def _verify(self) -> None:
        """While idle: is this worker still registered as it last published? Redis restarted empty, or the
        controller purged the worker, or a send failed: then resynchronise by snapshot."""
        if self._needs_snapshot or self._retired:
            return
        try:
            registered = self._redis.hget(pi.workers_key(self._prefix), self._publisher.worker_id)
        except self._errors as exc:
            self._mark_down(exc)
            self._resynchronise()
            return
        self.up = True
        expected = f"{self._publisher.incarnation} {self._publisher.role} {self._seq}".encode()
        if registered != expected:
            logger.info("prefix index: this worker's entries are gone or stale (%r); republishing a snapshot",
                        registered)
            self.stats.num_gaps += 1
            self._resynchronise()

    def _resynchronise(self) -> None:
        """The index may lack batches of ours: drop incremental ones until a snapshot is sent (asked of the engine
        on the next pass that finds Redis answering)."""
        self._needs_snapshot, self._snapshot_asked = True, False

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _connect(self) -> bool:
        """Whether Redis answers now (and the namespace is described in it); marks `up`."""
        try:
            self._redis.hset(pi.meta_key(self._prefix), mapping=pi.meta_mapping(self._namespace))
        except self._errors as exc:
            self._mark_down(exc)
            return False
        if not self.up:
            logger.info("prefix index: connected to Redis")
        self.up = True
        return True

    def _send(self, batch: pi.EventBatch, *, snapshot_dropped_before: int | None = None) -> None:
        """Apply one batch; `snapshot_dropped_before` is set for a snapshot (see `_Snapshot`)."""
        snapshot = snapshot_dropped_before is not None
        try:
            answer = self._apply(args=pi.apply_args(self._prefix, batch))
        except self._errors as exc:
            self._mark_down(exc)
            self._resynchronise()
            return
        answer = answer.decode() if isinstance(answer, bytes) else answer
        self.up = True
        if answer == pi.OK:
            self.stats.num_batches += 1
            if snapshot:
                self.stats.num_snapshots += 1
                self._snapshot_asked = False
                self._needs_snapshot = self._num_overflows != snapshot_dropped_before
        elif answer == pi.GAP:
            self.stats.num_gaps += 1
            logger.info("prefix index: sequence gap at batch %d; republishing a snapshot", batch.seq)
            self._resynchronise()
        else:  # STALE: a newer incarnation of this worker id publishes: this one is on its way out
            logger.warning("prefix index: a newer incarnation of %s publishes; this one stops publishing",
                           self._publisher.worker_id)
            self._retired = True

    def _mark_down(self, exc: BaseException) -> None:
        self.stats.num_errors += 1
        if self.up:
            logger.warning("prefix index: Redis unreachable (%s); events dropped until it is back", exc)
        self.up = False
        time.sleep(self._retry_interval_s)
