"""The workers the router knows: who they are (from a provider), how to reach them, and how loaded they are.

Lifecycle, all inside the serving event loop (grpc.aio channels belong to the loop that uses them):

    WorkerRegistry(provider)      no I/O
    await start()                 one refresh, then a background task refreshing every refresh_interval_s
        refresh() = provider() -> reconcile channels (one grpc.aio channel + stub per endpoint)
                    -> poll_loads(): GetLoad on every worker at once; an unreachable worker is marked unhealthy, one
                       that answers too late keeps its last load, marked stale (busy is not dead: only the
                       controller's liveness checks decide a worker is gone)
    await close()                 stops the task, closes the channels

The provider is the Ray controller's list in a cluster and a static list in tests: a plain callable (run in a
thread, since it may block) or an async one, returning `WorkerInfo`s. A provider failure keeps the last list.

A worker listed `draining` (a scale-down chose it: router/admin.py, deploy/controller.py) stays in the registry, so
the calls it holds go on, Aborts reach it and its load is polled, but routing never sees it (`loads()`).

Between polls the router counts what it dispatched itself (`note_dispatch`), so a burst of requests arriving
within one poll interval spreads over the workers instead of piling onto the one that looked idlest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from kv_transfer.block_hash import BlockHashNamespace
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import CALLER_KEEPALIVE, OPEN, ClusterAuth, aio_channel
from protos.worker_info import WorkerInfo
from router.routing import WorkerLoad

logger = logging.getLogger(__name__)

WorkerProvider = Callable[[], Sequence["WorkerInfo"] | Awaitable[Sequence["WorkerInfo"]]]

# A restarted worker should be reachable again within a poll or two, not after gRPC's default backoff (≤120 s).
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # a stream on a worker whose host is cut off fails (UNAVAILABLE: migrated) instead of hanging
    *CALLER_KEEPALIVE,
)
_CHANNEL_CLOSE_GRACE_S = 30.0  # in-flight calls on a worker that left the list may finish within this



@dataclass(frozen=True, kw_only=True)
class WorkerSnapshot:
    """A worker's latest known state, for /metrics and /health."""

    info: WorkerInfo
    healthy: bool
    stats: serving_pb2.LoadStats | None  # the latest successful GetLoad; None before the first
    error: str = ""  # why it is unhealthy, or why its load is stale
    stale: bool = False  # the last GetLoad timed out: `stats` is older than one poll


class _Worker:
    """Mutable per-worker state; only the registry touches it, from the event loop."""

    def __init__(self, info: WorkerInfo, stub: serving_pb2_grpc.WorkerStub) -> None:
        self.info = info
        self.stub = stub
        self.stats: serving_pb2.LoadStats | None = None
        self.healthy = False  # until the first GetLoad answers
        self.stale = False
        self.error = "not polled yet"
        self.num_pending = 0
        self.num_pending_blocks = 0
        # LoRA adapters this router loaded (an adapter) or unloaded (None) there, by name, counted: applied over any
        # load poll that was under way meanwhile (its answer may predate them), dropped by the first poll after them.
        self.lora_notes: dict[str, serving_pb2.LoRAAdapter | None] = {}
        self.num_lora_notes = 0
        # Load polls started, and the start number of the one whose answer `stats` holds: a poll answered after a
        # later one (a periodic poll beside a scrape's) is dropped, never applied over newer news.
        self.num_polls = 0
        self.stats_poll = 0


class WorkerRegistry:
    def __init__(
        self, provider: WorkerProvider, *, refresh_interval_s: float = 1.0, load_timeout_s: float = 2.0,
        auth: ClusterAuth = OPEN,
    ) -> None:
        """`auth`: the cluster secret (and TLS) every call to a worker carries."""
        if refresh_interval_s <= 0 or load_timeout_s <= 0:
            raise ValueError(f"intervals must be positive, got {refresh_interval_s}, {load_timeout_s}")
        self._provider = provider
        self._auth = auth
        self._refresh_interval_s = refresh_interval_s
        self._load_timeout_s = load_timeout_s
        self._workers: dict[str, _Worker] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, serving_pb2_grpc.WorkerStub] = {}
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()
        self._listeners: list[Callable[[], None]] = []

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Refresh once, then keep refreshing in the background until `close()`."""
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever(), name="worker-registry-refresh")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(channel.close() for channel in self._channels.values()), return_exceptions=True)
        self._channels.clear()
        self._stubs.clear()
        self._workers.clear()

    async def refresh(self) -> None:
        """Re-read the worker list from the provider, then poll every worker's load."""
        try:
            infos = await self._call_provider()
        except Exception:  # a flaky controller must not take routing down
            logger.exception("worker provider failed; keeping the last worker list")
        else:
            self._reconcile(infos)
        await self.poll_loads()

    async def poll_loads(self) -> None:
        """GetLoad on every worker concurrently; then tell the listeners."""
        await asyncio.gather(*(self._poll(worker) for worker in list(self._workers.values())))
        for listener in self._listeners:
            listener()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every load poll (on the event loop): the loads may have changed."""
        self._listeners.append(listener)

    # -- reads --------------------------------------------------------------------------------------------------

    def snapshots(self) -> list[WorkerSnapshot]:
        return [
            WorkerSnapshot(info=w.info, healthy=w.healthy, stats=w.stats, error=w.error, stale=w.stale)
            for w in self._workers.values()
        ]

    def loads(self) -> list[WorkerLoad]:
        """Routing's view: the polled counts plus what this router dispatched since; draining workers left out."""
        return [_load_of(worker) for worker in self._workers.values() if not worker.info.draining]

    def stub(self, worker_id: str) -> serving_pb2_grpc.WorkerStub:
        """The stub of a known worker; KeyError when it left the list."""
        return self._workers[worker_id].stub

    def hash_namespace(self) -> BlockHashNamespace | None:
        """The KV block hash namespace the workers report (they share one: the same model identity, block size
        and KV dtype); None until a healthy worker reported it."""
        for worker in self._workers.values():
            if worker.healthy and worker.stats is not None and worker.stats.HasField("kv_namespace"):
                ns = worker.stats.kv_namespace
                return BlockHashNamespace(model=ns.model, block_size=ns.block_size, kv_dtype=ns.kv_dtype)
        return None

    def lora_adapters(self) -> dict[str, serving_pb2.LoRAAdapter]:
        """The LoRA adapters the healthy workers that take requests serve, by name. Where workers hold different
        adapters under one name (a rollout of new files), the one most of them hold: requests go to those."""
        held: dict[str, dict[str, tuple[int, serving_pb2.LoRAAdapter]]] = {}  # name -> digest -> (workers, adapter)
        for worker in self._workers.values():
            if worker.healthy and not worker.info.draining and worker.stats is not None:
                for adapter in worker.stats.lora_adapters:
                    count, _ = held.setdefault(adapter.name, {}).get(adapter.digest, (0, adapter))
                    held[adapter.name][adapter.digest] = (count + 1, adapter)
        return {name: max(by_digest.values(), key=lambda held: held[0])[1] for name, by_digest in held.items()}

    def note_lora_adapter(self, worker_id: str, name: str, adapter: serving_pb2.LoRAAdapter | None) -> None:
        """A worker loaded (`adapter`) or unloaded the adapter `name` at this router's call: routed by at once,
        before its next GetLoad says so."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.lora_notes[name] = adapter
        worker.num_lora_notes += 1
        if worker.stats is not None:
            _apply_lora_notes(worker.stats, {name: adapter})

    def incarnations(self) -> dict[str, int]:
        """Worker id -> incarnation of the healthy workers that take requests (as each reports it)."""
        return {w.info.worker_id: _incarnation(w) for w in self._workers.values() if w.healthy and not w.info.draining}

    def healthy_roles(self) -> set[str]:
        """The roles with a healthy worker that takes requests."""
        return {w.info.role for w in self._workers.values() if w.healthy and not w.info.draining}

    # -- writes from dispatch -----------------------------------------------------------------------------------

    def note_dispatch(self, worker_id: str, num_blocks: int) -> None:
        """Count a request sent to `worker_id` until the next poll reflects it."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.num_pending += 1
            worker.num_pending_blocks += num_blocks

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        """Take a worker out of routing until its next successful poll (e.g. its Generate was UNAVAILABLE)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.healthy = False
            worker.error = reason

    def spawn(self, coroutine: Awaitable[object], name: str) -> None:
        """Run a fire-and-forget call (an Abort) that `close()` cancels if it is still running."""
        task: asyncio.Task[object] = asyncio.ensure_future(coroutine)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- internals ----------------------------------------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_interval_s)
            try:
                await self.refresh()
            except Exception:  # keep polling whatever one round did
                logger.exception("worker registry refresh failed")

    async def _call_provider(self) -> list[WorkerInfo]:
        if inspect.iscoroutinefunction(self._provider):
            result = await self._provider()
        else:
            result = await asyncio.to_thread(self._provider)
            if inspect.isawaitable(result):
                result = await result
        return list(result)  # type: ignore[arg-type]

    def _reconcile(self, infos: Sequence[WorkerInfo]) -> None:
        wanted = {info.worker_id: info for info in infos}
        for worker_id in [w for w in self._workers if w not in wanted]:
            logger.info("worker %s left the list", worker_id)
            del self._workers[worker_id]
        for worker_id, info in wanted.items():
            current = self._workers.get(worker_id)
            if current is not None and current.info == info:
                continue
            if current is not None and dataclasses.replace(current.info, draining=info.draining) == info:
                logger.info("worker %s %s", worker_id, "draining" if info.draining else "no longer draining")
                current.info = info  # the same process: its load and pending counts stay
                continue
            if current is not None:
                logger.info("worker %s changed: %s -> %s", worker_id, current.info, info)
            self._workers[worker_id] = _Worker(info, self._stub_for(info.endpoint))
        live = {w.info.endpoint for w in self._workers.values()}
        for endpoint in [e for e in self._channels if e not in live]:
            channel = self._channels.pop(endpoint)
            del self._stubs[endpoint]
            self.spawn(channel.close(grace=_CHANNEL_CLOSE_GRACE_S), name=f"close-channel-{endpoint}")

    def _stub_for(self, endpoint: str) -> serving_pb2_grpc.WorkerStub:
        if endpoint not in self._stubs:
            channel = aio_channel(endpoint, self._auth, options=_CHANNEL_OPTIONS)
            self._channels[endpoint] = channel
            self._stubs[endpoint] = serving_pb2_grpc.WorkerStub(channel)
        return self._stubs[endpoint]

    async def _poll(self, worker: _Worker) -> None:
        num_pending, num_pending_blocks = worker.num_pending, worker.num_pending_blocks
        num_lora_notes = worker.num_lora_notes
        worker.num_polls += 1
        poll = worker.num_polls
        try:
            stats = await worker.stub.GetLoad(serving_pb2.LoadRequest(), timeout=self._load_timeout_s)
        except grpc.aio.AioRpcError as error:
            worker.error = f"GetLoad failed: {error.code().name} {error.details() or ''}".strip()
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and worker.stats is not None:
                if not worker.stale:
                    logger.warning("worker %s: load poll timed out; routing on its last load", worker.info.worker_id)
                worker.stale = True  # busy, not dead
                return
            if worker.healthy:
                logger.warning("worker %s unhealthy: GetLoad %s", worker.info.worker_id, error.code().name)
            worker.healthy = False
            return
        if poll < worker.stats_poll:  # a later poll's answer is in already
            return
        worker.stats_poll = poll
        if worker.num_lora_notes == num_lora_notes:  # this answer postdates every note
            worker.lora_notes.clear()
        else:
            _apply_lora_notes(stats, worker.lora_notes)
        worker.stats = stats
        worker.healthy = True
        worker.stale = False
        worker.error = ""
        # What was dispatched before the call is in these counts now; what came during it may not be.
        worker.num_pending = max(worker.num_pending - num_pending, 0)
        worker.num_pending_blocks = max(worker.num_pending_blocks - num_pending_blocks, 0)


def _apply_lora_notes(stats: serving_pb2.LoadStats, notes: dict[str, serving_pb2.LoRAAdapter | None]) -> None:
    kept = [a for a in stats.lora_adapters if a.name not in notes]
    del stats.lora_adapters[:]
    stats.lora_adapters.extend([*kept, *(a for a in notes.values() if a is not None)])


def _incarnation(worker: _Worker) -> int:
    return worker.stats.incarnation if worker.stats is not None else worker.info.incarnation


def _load_of(worker: _Worker) -> WorkerLoad:
    stats = worker.stats
    if stats is None:
        return WorkerLoad(worker_id=worker.info.worker_id, role=worker.info.role, endpoint=worker.info.endpoint,
                          healthy=worker.healthy, num_pending=worker.num_pending,
                          incarnation=worker.info.incarnation)
    return WorkerLoad(
        worker_id=worker.info.worker_id,
        role=worker.info.role,
        endpoint=worker.info.endpoint,
        healthy=worker.healthy,
        num_running=stats.num_requests_running,
        num_waiting=stats.num_requests_waiting,
        num_receiving_kv=stats.num_requests_receiving_kv,
        num_pending=worker.num_pending,
        kv_blocks_free=max(stats.kv_blocks_free - worker.num_pending_blocks, 0),
        kv_blocks_total=stats.kv_blocks_total,
        max_num_seqs=stats.max_num_seqs,
        incarnation=stats.incarnation,
        kv_block_bytes=stats.kv_block_bytes,
        lora_adapters=frozenset((a.name, a.digest) for a in stats.lora_adapters),
    )
