"""One process's workers: build them by role, share one loaded checkpoint between them, start, check, stop.

Normally a host runs one worker and is the body of one Ray actor (`deploy.controller` wraps it). With the
in-process KV transport every prefill and decode worker must live in one process, so the controller gives one
host all of them; they then share a single copy of the weights.

    WorkerHost(configs) ──start()──▶ [WorkerInfo] ──health()──▶ {worker_id: ok} ──stop()
                        ──add(configs)──▶ [WorkerInfo]     ──drain(worker_ids, timeout_s)──▶ remove(worker_ids)

This module is plain Python (no Ray) and imports neither torch nor the worker packages until a worker is built,
so the controller and tests import it anywhere.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from engine.config import EngineConfig
from protos.cluster_auth import sync_channel
from protos.worker_info import WorkerInfo
from worker.config import WorkerConfig

if TYPE_CHECKING:
    from engine.loader.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

# A worker's liveness, as `WorkerHost.health` reports it (and the controller's restart reasons name it).
LIVE, STALLED, UNRESPONSIVE = "live", "stalled", "unresponsive"

WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # a worker bound to one of these advertises its node's address instead


class Worker(Protocol):
    """What `prefill_worker.worker.PrefillWorker` and `decode_worker.worker.DecodeWorker` provide."""

    worker_id: str
    role: str
    incarnation: int

    def start(self) -> str:
        """Start the engine loop and the gRPC server; return the bound endpoint "host:port"."""
        ...

    def stop(self) -> None:
        """Stop serving and free everything. Idempotent."""
        ...

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests at once (retryably) and wait up to `timeout_s` for those in flight; return how many
        are still in flight."""
        ...


class WorkerFactory(Protocol):
    """How a host gets its workers. Must pickle: the controller ships it to each host's process."""

    def load_checkpoint(self, engine: EngineConfig) -> Any:
        """Load what the workers of this engine config share (weights, tokenizer). Called once per
        (model, dtype, load format) per host."""
        ...

    def build(self, config: WorkerConfig, checkpoint: Any) -> Worker:
        """A not yet started worker for `config`."""
        ...


class RoleWorkerFactory:
    """The real workers: `PrefillWorker` for role "prefill", `DecodeWorker` for "decode" and "colocated"."""

    def load_checkpoint(self, engine: EngineConfig) -> Checkpoint:
        from engine.device import resolve_engine_config  # torch loads here, in the worker's process
        from engine.loader.checkpoint import load_engine_checkpoint

        return load_engine_checkpoint(resolve_engine_config(engine))

    def build(self, config: WorkerConfig, checkpoint: Checkpoint) -> Worker:
        if config.role == "prefill":
            from prefill_worker.worker import PrefillWorker

            return PrefillWorker(config, checkpoint=checkpoint)
        from decode_worker.worker import DecodeWorker

        return DecodeWorker(config, checkpoint=checkpoint)


@dataclass(frozen=True, kw_only=True)
class _Running:
    worker: Worker
    info: WorkerInfo
    channel: grpc.Channel  # to its own gRPC server, for health checks


class WorkerHost:
    """Owns the workers of one process. Not thread-safe: its Ray actor runs one method at a time.

    Lifecycle: `start()` builds and starts the constructor's configs (all or nothing: if one fails, those
    already started are stopped and the error propagates); `add`/`remove` change the set later; `stop()` stops
    everything and may be called any number of times.
    """

    def __init__(self, configs: Sequence[WorkerConfig] = (), *, factory: WorkerFactory | None = None,
                 node_ip: str = "127.0.0.1", node_id: str = "") -> None:
        """`node_ip`: the address peers reach this machine at, advertised by workers that bind a wildcard
        address; `node_id`: the Ray node this process runs on, published with each worker."""
        ids = [c.worker_id for c in configs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate worker ids: {ids}")
        self._pending = list(configs)
        self._factory: WorkerFactory = factory or RoleWorkerFactory()
        self._checkpoints: dict[tuple[str, str, str], Any] = {}  # (model, dtype, load format) -> shared checkpoint
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()  # cheap insurance for in-process (non-actor) use from several threads
        self._node_ip = node_ip
        self._node_id = node_id

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> list[WorkerInfo]:
        """Build and start the workers given to the constructor; return their infos."""
        configs, self._pending = self._pending, []
        return self.add(configs)

    def add(self, configs: Iterable[WorkerConfig]) -> list[WorkerInfo]:
        """Build and start more workers in this process. All or nothing, like `start()`."""
        configs = list(configs)
        with self._lock:
            clash = [c.worker_id for c in configs if c.worker_id in self._running]
            if clash:
                raise ValueError(f"workers already running here: {clash}")
            started: list[str] = []
            try:
                for config in configs:
                    self._running[config.worker_id] = self._start_one(config)
                    started.append(config.worker_id)
            except BaseException:
                for worker_id in started:
                    self._stop_one(self._running.pop(worker_id))
                raise
            return [self._running[w].info for w in started]

    def remove(self, worker_ids: Iterable[str]) -> None:
        """Stop these workers; unknown ids are ignored (a retried remove is harmless)."""
        with self._lock:
            for worker_id in worker_ids:
                running = self._running.pop(worker_id, None)
                if running is not None:
                    self._stop_one(running)

    def drain(self, worker_ids: Iterable[str], timeout_s: float) -> dict[str, int]:
        """Drain these workers at once (each refuses new requests now, and finishes what it holds within
        `timeout_s`); return worker id -> requests still in flight at the end (0: drained). Unknown ids are
        ignored. The workers keep running: `remove` stops them."""
        running = [r for w in worker_ids if (r := self._running.get(w)) is not None]
        if not running:
            return {}
        with ThreadPoolExecutor(max_workers=len(running), thread_name_prefix="drain") as pool:
            left = list(pool.map(lambda r: _drain_one(r, timeout_s), running))
        return {r.info.worker_id: n for r, n in zip(running, left)}

    def stop(self) -> None:
        """Stop every worker here. Idempotent; never raises for a worker that fails to stop."""
        self.remove(list(self._running))

    # -- queries ---------------------------------------------------------------------------------------------
    def infos(self) -> list[WorkerInfo]:
        return [r.info for r in self._running.values()]

    def health(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Liveness of each worker, from its own gRPC server's `Health` (answered apart from the request path):
        LIVE when it answers in time with ok, its id and this incarnation; STALLED when it answers but its engine
        loop is dead or stuck in one step; UNRESPONSIVE when it does not answer in time, or a stale server on a
        reused port answers instead."""
        from protos import serving_pb2, serving_pb2_grpc

        result: dict[str, str] = {}
        for worker_id, running in list(self._running.items()):
            try:
                reply = serving_pb2_grpc.WorkerStub(running.channel).Health(
                    serving_pb2.HealthRequest(), timeout=timeout_s
                )
            except grpc.RpcError as exc:
                logger.warning("worker %s failed its health check: %s", worker_id, exc.code())
                result[worker_id] = UNRESPONSIVE
                continue
            if reply.worker_id != worker_id or reply.incarnation != running.info.incarnation:
                result[worker_id] = UNRESPONSIVE
            else:
                result[worker_id] = LIVE if reply.ok else STALLED
        return result

    def pid(self) -> int:
        return os.getpid()

    # -- internals -------------------------------------------------------------------------------------------
    def _checkpoint_for(self, engine: EngineConfig) -> Any:
        key = (engine.model, engine.dtype, engine.load_format)
        if key not in self._checkpoints:
            self._checkpoints[key] = self._factory.load_checkpoint(engine)
        return self._checkpoints[key]

    def _start_one(self, config: WorkerConfig) -> _Running:
        from worker.fresh_thread import run_on_fresh_thread

        if config.host in WILDCARD_HOSTS and not config.advertise_host:
            config = replace(config, advertise_host=self._node_ip)
        # Weights and engine are built on a thread that then exits: the engine loop's thread must be this
        # process's only OpenMP master (worker/fresh_thread.py).
        worker = run_on_fresh_thread(lambda: self._factory.build(config, self._checkpoint_for(config.engine)))
        try:
            endpoint = worker.start()
        except BaseException:
            worker.stop()
            raise
        info = WorkerInfo(
            worker_id=config.worker_id,
            role=config.role,
            endpoint=endpoint,
            incarnation=config.incarnation,
            pid=os.getpid(),
            rank_pids=tuple(worker.runtime.engine.rank_pids()) if hasattr(worker, "runtime") else (),
            node_id=self._node_id,
        )
        logger.info("started %s (incarnation %d) at %s", info.worker_id, info.incarnation, endpoint)
        return _Running(worker=worker, info=info, channel=sync_channel(endpoint, config.auth))

    @staticmethod
    def _stop_one(running: _Running) -> None:
        running.channel.close()
        try:
            running.worker.stop()
        except Exception:  # a failing stop must not keep the other workers running
            logger.exception("worker %s failed to stop cleanly", running.info.worker_id)


def _drain_one(running: _Running, timeout_s: float) -> int:
    try:
        return running.worker.drain(timeout_s)
    except Exception:  # a failed drain only means the stop that follows cuts what it held (the gateway migrates)
        logger.exception("worker %s failed to drain", running.info.worker_id)
        return -1
