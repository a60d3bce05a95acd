"""What every worker process runs: the engine on its loop thread, a gRPC server, the common RPCs.

    WorkerRuntime(config, checkpoint)
      .engine / .loop        the LLMEngine and the thread that owns it
      .server / .endpoint    grpc.Server bound at construction ("host:port"); role servicers register on it
      .start() / .stop()     loop and server up / down (stop aborts every request, freeing its blocks)

The role classes (`prefill_worker.PrefillWorker`, `decode_worker.DecodeWorker`) compose one and add their RPCs
through a servicer subclassing `WorkerServicer`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from engine.llm_engine import TORCH_DTYPES, LLMEngine
from engine.loader.checkpoint import Checkpoint, load_checkpoint
from engine.serving.engine_loop import EngineLoop
from engine.serving.malloc_tuning import tune_malloc
from engine.serving.worker_config import WorkerConfig
from kv_transfer.grpc_transport import CHANNEL_OPTIONS
from kv_transfer.layout import KVLayout
from protos import serving_pb2, serving_pb2_grpc

logger = logging.getLogger(__name__)

# The worker's server takes KV blocks (gRPC transport) and long prompts' token ids and logprobs: big messages and
# large HTTP/2 frames (kv_transfer.grpc_transport.CHANNEL_OPTIONS).
GRPC_OPTIONS = CHANNEL_OPTIONS


@dataclass
class TransferCounters:
    """KV handoffs this worker sent (prefill) or received (decode). Guarded by `lock`."""

    lock: threading.Lock
    num_bytes: int = 0
    seconds: float = 0.0
    num_transfers: int = 0
    num_failures: int = 0

    def record(self, num_bytes: int, seconds: float) -> None:
        with self.lock:
            self.num_bytes += num_bytes
            self.seconds += seconds
            self.num_transfers += 1

    def record_failure(self) -> None:
        with self.lock:
            self.num_failures += 1


class RuntimeWorker:
    """What the prefill and decode workers share: identity from their config, start through their runtime."""

    config: WorkerConfig
    runtime: WorkerRuntime

    worker_id = property(lambda self: self.config.worker_id)
    role = property(lambda self: self.config.role)
    incarnation = property(lambda self: self.config.incarnation)
    endpoint = property(lambda self: self.runtime.endpoint)

    def start(self) -> str:
        return self.runtime.start()


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        tune_malloc()  # before the gRPC server's threads exist: they then share one arena
        if checkpoint is None:
            checkpoint = load_checkpoint(config.engine.model, dtype=TORCH_DTYPES[config.engine.dtype])
        self.engine = LLMEngine(config.engine, checkpoint)
        self.loop = EngineLoop(self.engine, name=f"{config.worker_id}-engine")
        self.transfers = TransferCounters(lock=threading.Lock())
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=64, thread_name_prefix=f"{config.worker_id}-rpc"), options=GRPC_OPTIONS
        )
        port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        if port == 0:
            raise RuntimeError(f"worker {config.worker_id}: cannot bind {config.host}:{config.port}")
        self.endpoint = f"{config.host}:{port}"
        mc = self.engine.model_config
        self.layout = KVLayout(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=config.engine.block_size,
            dtype=config.engine.dtype,
        )
        self._started = False
        self._stopped = False

    def start(self) -> str:
        if not self._started:
            self._started = True
            self.loop.start()
            self.server.start()
            logger.info("worker %s (%s) serving on %s", self.config.worker_id, self.config.role, self.endpoint)
        return self.endpoint

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop taking RPCs, abort what runs, stop the loop. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.server.stop(grace_s).wait(grace_s + 1.0)
        self.loop.stop()

    # -- the common RPCs -------------------------------------------------------------------------------------
    def health(self) -> serving_pb2.HealthResponse:
        return serving_pb2.HealthResponse(
            ok=self.loop.is_alive,
            worker_id=self.config.worker_id,
            role=self.config.role,
            model=self.engine.model_config.name,
            incarnation=self.config.incarnation,
        )

    def load_stats(self) -> serving_pb2.LoadStats:
        def snapshot(engine: LLMEngine) -> serving_pb2.LoadStats:
            pool = engine.block_pool
            return serving_pb2.LoadStats(
                num_requests_running=engine.scheduler.num_running,
                num_requests_waiting=engine.scheduler.num_waiting,
                kv_blocks_used=pool.num_used_blocks,
                kv_blocks_free=pool.num_free_blocks,
                kv_blocks_total=engine.num_kv_blocks,
                kv_cache_usage=pool.usage,
                prefix_cache_queries=engine.kv_cache.prefix_queries_tokens,
                prefix_cache_hits=engine.kv_cache.prefix_hits_tokens,
                num_preemptions=engine.scheduler.num_preemptions,
            )

        stats = self.loop.call(snapshot, timeout_s=10.0)
        stats.worker_id = self.config.worker_id
        stats.role = self.config.role
        stats.incarnation = self.config.incarnation
        stats.cpu_kernels.extend(
            serving_pb2.CpuKernel(kernel=k.kernel, variant=k.variant) for k in self.engine.cpu_kernels
        )
        with self.transfers.lock:
            stats.kv_transfer_bytes = self.transfers.num_bytes
            stats.kv_transfer_seconds = self.transfers.seconds
            stats.num_kv_transfers = self.transfers.num_transfers
            stats.num_kv_transfer_failures = self.transfers.num_failures
        return stats

    def abort(self, request_id: str) -> bool:
        outs = self.loop.call(lambda e: e.abort_request([request_id]), timeout_s=10.0)
        return bool(outs)


class WorkerServicer(serving_pb2_grpc.WorkerServicer):
    """Health, GetLoad and Abort for every role; roles add Generate or Prefill."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def Health(self, request: serving_pb2.HealthRequest, context: grpc.ServicerContext) -> serving_pb2.HealthResponse:
        return self.runtime.health()

    def GetLoad(self, request: serving_pb2.LoadRequest, context: grpc.ServicerContext) -> serving_pb2.LoadStats:
        return self.runtime.load_stats()

    def Abort(self, request: serving_pb2.AbortRequest, context: grpc.ServicerContext) -> serving_pb2.AbortResponse:
        return serving_pb2.AbortResponse(found=self.runtime.abort(request.request_id))


def elapsed_s(start: float | None, end: float | None) -> float:
    """A duration from two monotonic stamps, 0 when either is missing."""
    if start is None or end is None:
        return 0.0
    return max(end - start, 0.0)


def now_s() -> float:
    return time.monotonic()
