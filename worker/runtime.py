"""What every worker process runs: the engine on its loop thread, a grpc.aio server, the common RPCs.

    WorkerRuntime(config, checkpoint)
      .engine / .loop        the LLMEngine and the thread that owns it
      .aio                   the asyncio loop (its own thread) the server and every handler run on
      .server / .endpoint    grpc.aio.Server bound at construction ("host:port"); role servicers register on it
      .start() / .stop()     loop and server up / down (stop aborts every request, freeing its blocks)
      .gate / .drain(t)      the request RPCs' gate (worker/request_gate.py); drain: refuse new
                             requests, wait up to t seconds for those in flight (before a scale-down's stop)
      await .call(fn)        fn(engine) on the engine thread, awaited from a handler without blocking the loop
      .outputs(request_id)   an asyncio.Queue fed with the request's RequestOutputs from the engine thread

    engine thread ──outputs──▶ call_soon_threadsafe ──▶ asyncio.Queue ──▶ handler coroutine ──▶ stream
    handler coroutine ──call(fn)──▶ EngineLoop.submit ──▶ engine thread (between steps) ──▶ future ──▶ handler

An open Generate stream is a coroutine waiting on its queue: thousands cost memory, not threads, and Health and
GetLoad are answered on the same loop at once, whatever the streams do. Handlers that must block (a KV send, a
transport's sync servicer) run on the loop's small executor or the server's migration pool.

The role classes (`prefill_worker.PrefillWorker`, `decode_worker.DecodeWorker`) compose one and add their RPCs
through a servicer subclassing `WorkerServicer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
import grpc.aio

from engine.config import SpeculativeConfig
from engine.core.fork import choice_request_id
from engine.core.stats import EngineStats
from engine.device import resolve_engine_config
from engine.llm_engine import LLMEngine
from engine.loader.checkpoint import Checkpoint, load_engine_checkpoint
from engine.core.request import Request
from engine.lora.registry import LoRARegistry
from engine.request.lora import LoRAError
from engine.request.sampling_params import SamplingParams
from engine.outputs import RequestOutput
from kv_transfer.grpc_link import CHANNEL_OPTIONS
from kv_transfer.layout import KV_CACHE_DTYPES as HANDOFF_KV_CACHE_DTYPES
from kv_transfer.base import KVSender
from kv_transfer.prefix_index import PublisherId
from kv_transfer.rank_lanes import LANE_TRANSPORTS
from kv_transfer.registry import make_receiver, make_sender
from kv_transfer.reservation import ReservationSink
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import CALLER_KEEPALIVE, SERVER_KEEPALIVE, add_port, server_interceptors
from worker.admissions import Admissions
from worker.config import WorkerConfig
from worker.engine_loop import EngineLoop, EngineLoopClosed
from worker.event_loop_thread import EventLoopThread
from worker.kv_event_publisher import NullPublisher, RedisKVEventPublisher
from worker.malloc_tuning import tune_malloc
from worker.peer_fetch import PeerFetcher
from worker.request_gate import RequestGate

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Fault injection for the liveness tests (like prefill_worker's SPLITSERVE_FAULT_KV_CUTS, reachable through
# `splitserve serve`): every engine step sleeps this long first, so the worker is busy but alive.
FAULT_STEP_SLEEP_ENV = "SPLITSERVE_FAULT_STEP_SLEEP_S"

# Threads for the KV transports' sync servicers (one per handoff in flight), not for requests.
_MIGRATION_THREADS = 16

# The worker's server takes KV blocks (gRPC transport) and long prompts' token ids and logprobs: big messages and
# large HTTP/2 frames (kv_transfer.grpc_link.CHANNEL_OPTIONS); it lets callers ping it as often as their keepalive
# does. Its own calls (a decode worker's Prefill call) keep alive the same way, so that a prefill host cut off fails
# that call within seconds (protos/cluster_auth.py).
SERVER_OPTIONS = (*CHANNEL_OPTIONS, *SERVER_KEEPALIVE)
CALLER_OPTIONS = (*CHANNEL_OPTIONS, *CALLER_KEEPALIVE)


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

    def drain(self, timeout_s: float) -> int:
        return self.runtime.drain(timeout_s)


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        tune_malloc()  # before the gRPC server's threads exist: they then share one arena
        engine_config = resolve_engine_config(config.engine)  # the device and dtype this worker runs with
        if engine_config.kv_cache_dtype not in HANDOFF_KV_CACHE_DTYPES and config.role != "colocated":
            # The KV layout and the transports move unquantized blocks, int8 ones with their scales and fp8 ones (all
            # of the engine's today: this guards a cache dtype added to the engine and not to the wire).
            raise ValueError(f"--kv-cache-dtype {engine_config.kv_cache_dtype}: KV handoffs do not carry such "
                             "blocks yet; run colocated workers (--num-colocated-workers) or --kv-cache-dtype "
                             f"{' or '.join(HANDOFF_KV_CACHE_DTYPES)}")
        if checkpoint is None:
            checkpoint = load_engine_checkpoint(engine_config)
        self.engine = LLMEngine(engine_config, checkpoint)
        if config.role != "colocated" and self.engine.kv_blocks.ranks is None and \
                config.kv_transport not in LANE_TRANSPORTS:
            self.engine.close()
            raise ValueError(f"a {config.role} worker at tensor_parallel_size {engine_config.tensor_parallel_size} "
                             f"on {self.engine.device.type}: its child ranks did not share their KV caches, so no "
                             f"{config.kv_transport} handoff could reach them; use --kv-transport grpc, torch or ipc "
                             "(each rank sends and receives its own KV heads) or serve it colocated")
        self.device = self.engine.device  # where its KV blocks live: the transports read and write them there
        _inject_slow_steps(self.engine, float(os.environ.get(FAULT_STEP_SLEEP_ENV, "0") or 0))
        self.loop = EngineLoop(self.engine, name=f"{config.worker_id}-engine")
        self.kv_events = self._make_publisher()
        self.engine.kv_event_sink = self.kv_events.publish
        self.transfers = TransferCounters(lock=threading.Lock())
        self.admissions = Admissions()  # requests its handlers took in that the engine does not hold yet
        self.aio = EventLoopThread(f"{config.worker_id}-grpc")
        self.server: grpc.aio.Server = self.aio.run(self._make_server())
        port = add_port(self.server, f"{config.host}:{config.port}", config.auth)
        if port == 0:
            self.aio.stop()
            raise RuntimeError(f"worker {config.worker_id}: cannot bind {config.host}:{config.port}")
        self.endpoint = f"{config.advertise_host or config.host}:{port}"
        self.layout = self.engine.kv_blocks.layout
        # Handoffs at TP > 1 go rank to rank, each rank its own lanes (kv_transfer/rank_lanes.py; not inproc): a
        # decode worker's children serve their own endpoints, which it names in each Prefill call (`rank_endpoints`,
        # its own first; at TP 1 just its own, so that a prefill worker at TP > 1 sends lanes to it).
        lanes = config.kv_transport in LANE_TRANSPORTS
        self.lanes = self.engine.rank_lanes() if lanes else None
        self.rank_endpoints: list[str] = []
        try:
            children = [] if self.lanes is None else self.lanes.start(
                config.kv_transport, self.layout, config.auth, host=config.host,
                advertise_host=config.advertise_host or "", worker_id=config.worker_id, serve=config.role == "decode")
        except Exception:
            self.aio.stop()
            self.engine.close()
            raise
        if config.role == "decode" and lanes:
            self.rank_endpoints = [self.endpoint, *children]
        # Receiving KV: a decode worker's handoffs, and every role's peer fetches; sending: a prefill worker's
        # handoffs, and every role's blocks a peer fetches (worker/peer_fetch.py). The sender is made on first use.
        self.sink = ReservationSink(self.layout, self.device)
        self.receiver = make_receiver(config.kv_transport, self.sink)
        self.receiver.attach(self.server, self.endpoint)
        self._sender: KVSender | None = None
        self._sender_lock = threading.Lock()
        self.peer = PeerFetcher(self, self.sink, self.sender)
        self._rank_stats = self.engine.rank_stats()  # fixed for the engine's life
        self.gate = RequestGate()
        self._started = False
        self._stopped = False

    def sender(self) -> KVSender:
        """This worker's KV sender (`--kv-transport`), made on first use. Thread-safe."""
        with self._sender_lock:
            if self._sender is None:
                self._sender = make_sender(self.config.kv_transport, worker_id=self.config.worker_id,
                                           device=self.device, auth=self.config.auth)
            return self._sender

    async def _make_server(self) -> grpc.aio.Server:  # on the loop: the server belongs to it
        migration = ThreadPoolExecutor(max_workers=_MIGRATION_THREADS, thread_name_prefix=f"{self.config.worker_id}-kv")
        # Every call, the KV receiver's included, must carry the cluster secret (protos/cluster_auth.py).
        return grpc.aio.server(migration_thread_pool=migration, options=SERVER_OPTIONS,
                               interceptors=server_interceptors(self.config.auth))

    def start(self) -> str:
        if not self._started:
            self._started = True
            self.loop.start()
            self.kv_events.start()
            self.aio.run(self.server.start())
            logger.info("worker %s (%s) serving on %s", self.config.worker_id, self.config.role, self.endpoint)
        return self.endpoint

    def drain(self, timeout_s: float) -> int:
        """Refuse new Generate / Prefill calls (UNAVAILABLE, retryable) and wait up to `timeout_s` for those in
        flight to end; return how many are still in flight (0: drained). Call from any thread but the loop's; the
        worker keeps serving Health, GetLoad, Abort and KV transfers until `stop()`."""
        if self._stopped:
            return 0
        return self.aio.run(self.gate.wait_idle(timeout_s), timeout_s=timeout_s + 5.0)

    def stop(self, grace_s: float = 2.0, *, before_loop_stops: Callable[[], object] | None = None) -> None:
        """Stop taking RPCs, abort what runs, stop the loop. Idempotent. `before_loop_stops` (a coroutine
        function) closes what a role opened on the asyncio loop (its client channels)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.aio.run(self.server.stop(grace_s), timeout_s=grace_s + 5.0)
            if before_loop_stops is not None:
                self.aio.run(before_loop_stops(), timeout_s=5.0)  # type: ignore[arg-type]
            self.aio.run(self.peer.close(), timeout_s=5.0)
        except Exception:  # noqa: BLE001 - stopping must go on
            logger.exception("worker %s: stopping its server failed", self.config.worker_id)
        self.receiver.close()
        with self._sender_lock:
            if self._sender is not None:
                self._sender.close()
        self.loop.stop()
        self.engine.close_kv_tier()  # --kv-offload-dir: the prefix cache kept for the next start, its slot freed
        self.kv_events.close()
        self.aio.stop()

    def _make_publisher(self) -> NullPublisher | RedisKVEventPublisher:
        """The KV event publisher: to the Redis prefix index when one is configured, else one that drops."""
        if self.config.redis_url is None:
            return NullPublisher()
        publisher: RedisKVEventPublisher

        def snapshot(engine: LLMEngine) -> None:  # on the engine thread: after every event already published
            engine.publish_kv_events()
            publisher.offer_snapshot(engine.cached_blocks())

        def request_snapshot() -> None:
            try:
                self.loop.submit(snapshot)
            except EngineLoopClosed:
                pass  # stopping: nothing more to publish

        publisher = RedisKVEventPublisher(
            redis_url=self.config.redis_url, namespace=self.engine.hash_namespace,
            publisher=PublisherId(worker_id=self.config.worker_id, incarnation=self.config.incarnation,
                                  role=self.config.role),
            request_snapshot=request_snapshot)
        return publisher

    # -- the engine, from a handler coroutine ----------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` on the engine thread between steps; its result or exception, awaited."""
        return await asyncio.wrap_future(self.loop.submit(fn))

    async def call_now(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` under the engine's lock on a thread of the executor, during a step's compute if one runs
        (EngineLoop.call_now says what may: what leaves the computing step alone)."""
        return await asyncio.to_thread(self.loop.call_now, fn)

    def outputs(self, request_id: str, num_choices: int = 1, *,
                on_engine_thread: Callable[[RequestOutput], None] | None = None) -> asyncio.Queue[RequestOutput]:
        """Listen for `request_id`'s outputs, those of its `num_choices` choices (n > 1) all in one queue (call on
        the asyncio loop, before the request can produce any); undo with `unlisten` (each choice's listener goes
        by itself after its finished output). `on_engine_thread(out)` runs first, on the engine thread right after
        the step that made `out` (before the next step starts), for what must be read off the engine then."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        aio_loop = asyncio.get_running_loop()

        def listener(out: RequestOutput) -> None:
            if on_engine_thread is not None:
                try:
                    on_engine_thread(out)
                except Exception:  # noqa: BLE001 - the output must reach its caller all the same
                    logger.exception("reading %s's output on the engine thread failed", out.request_id)
            aio_loop.call_soon_threadsafe(queue.put_nowait, out)

        for index in range(num_choices):
            self.loop.listen(choice_request_id(request_id, index), listener)
        return queue

    def unlisten(self, request_id: str, num_choices: int = 1) -> None:
        for index in range(num_choices):
            self.loop.unlisten(choice_request_id(request_id, index))

    # -- the common RPCs -------------------------------------------------------------------------------------
    def health(self) -> serving_pb2.HealthResponse:
        """Liveness, answered on the asyncio loop without the engine: its loop thread is alive and not stuck in
        one step for over `stall_timeout_s`, and every tensor-parallel rank runs (one dead rank fails the whole
        worker: the controller restarts it, all ranks, as a new incarnation). However busy the engine is, this
        answers at once."""
        return serving_pb2.HealthResponse(
            ok=(self.loop.is_alive and self.loop.step_running_s() < self.config.stall_timeout_s
                and self.engine.failure() is None),
            worker_id=self.config.worker_id,
            role=self.config.role,
            model=self.engine.model_config.name,
            incarnation=self.config.incarnation,
            engine_model=self.config.engine.model,
            load_format=self.config.engine.load_format,
            block_size=self.engine.config.block_size,
            max_model_len=self.engine.max_model_len,
            kv_cache_dtype=self.engine.config.kv_cache_dtype,
            quantization=self.engine.config.quantization,
            scheduling_policy=self.engine.config.scheduling_policy,
            max_logprobs=self.engine.config.max_logprobs,
        )

    async def load_stats(self) -> serving_pb2.LoadStats:
        """The engine's gauges and counters, read under its lock while a step computes, not after the step: during
        a long prefill the router's poll gets an answer. The requests whose queueing still waits for the step
        boundary count as waiting (worker/admissions.py)."""
        engine = self.engine  # its config, size and namespace are fixed at start
        now, admitting = await self.call_now(lambda e: (e.stats(take_finished=False), self.admissions.count))
        namespace = engine.hash_namespace
        stats = serving_pb2.LoadStats(
            num_requests_running=now.num_requests_running,
            num_requests_waiting=now.num_requests_waiting + admitting,
            num_requests_receiving_kv=now.num_requests_receiving_kv,
            num_queued_prompt_tokens=now.num_queued_prompt_tokens,
            kv_blocks_used=now.kv_blocks_used,
            kv_blocks_free=now.kv_blocks_free,
            kv_blocks_total=engine.num_kv_blocks,
            kv_cache_usage=now.kv_cache_usage,
            prefix_cache_queries=now.prefix_cache_queries,
            prefix_cache_hits=now.prefix_cache_hits,
            num_preemptions=now.num_preemptions,
            max_num_seqs=engine.config.max_num_seqs,
            kv_namespace=serving_pb2.KVNamespace(model=namespace.model, block_size=namespace.block_size,
                                                 kv_dtype=namespace.kv_dtype),
            # Decode-side speculation (any worker's engine speculates for what it decodes); zeros without it.
            spec_decode_num_drafts=now.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=now.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=now.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=now.spec_decode_num_accepted_tokens_per_pos,
            spec_decode_chosen_k=chosen_k_counts(now, engine.config.speculative_config),
        )
        stats.worker_id = self.config.worker_id
        stats.role = self.config.role
        stats.incarnation = self.config.incarnation
        stats.prefix_index_up = self.kv_events.up
        stats.quantization = engine.config.quantization
        if engine.loras is not None:  # --enable-lora
            stats.lora_adapters.extend(serving_pb2.LoRAAdapter(name=a.name, digest=a.digest, path=a.path)
                                       for a in engine.loras.adapters())
            stats.max_loras = engine.config.max_loras
            stats.lora_requests_running.update(now.lora_requests_running)
            stats.lora_requests_waiting.update(now.lora_requests_waiting)
        lanes = self.lanes
        stats.ranks.extend(serving_pb2.RankStats(
            rank=r.rank, pid=r.pid, weight_bytes=r.weight_bytes, kv_cache_bytes=r.kv_cache_bytes,
            kv_lane_bytes_sent=lanes.bytes_sent[r.rank] if lanes is not None else 0,
            kv_lane_bytes_received=lanes.bytes_received[r.rank] if lanes is not None else 0,
        ) for r in self._rank_stats)
        stats.prefix_cache_hits_by_tier.update(now.prefix_cache_hits_by_tier)
        if now.kv_offload is not None:  # its KV offload tier (--kv-offload-dir)
            stats.kv_offload_bytes.update(write=now.kv_offload.bytes_written, read=now.kv_offload.bytes_read)
        stats.cpu_kernels.extend(
            serving_pb2.CpuKernel(kernel=k.kernel, variant=k.variant) for k in self.engine.cpu_kernels
        )
        stats.kv_transfers_rejected.update(self.receiver.rejections())
        stats.kv_block_bytes = self.layout.block_bytes
        fetched_blocks, fetched_bytes, fetch_seconds, fetch_failures = self.peer.stats()
        stats.kv_peer_fetch_blocks = fetched_blocks
        stats.kv_peer_fetch_bytes = fetched_bytes
        stats.kv_peer_fetch_seconds = fetch_seconds
        stats.kv_peer_fetch_failures.update(fetch_failures)
        with self.transfers.lock:
            stats.kv_transfer_bytes = self.transfers.num_bytes
            stats.kv_transfer_seconds = self.transfers.seconds
            stats.num_kv_transfers = self.transfers.num_transfers
            stats.num_kv_transfer_failures = self.transfers.num_failures
        return stats

    async def abort(self, request_id: str) -> bool:
        outs = await self.call(lambda e: e.abort_request([request_id]))
        return bool(outs)


class WorkerServicer(serving_pb2_grpc.WorkerServicer):
    """Health, GetLoad and Abort for every role; roles add Generate or Prefill, each inside `admitted`."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    @contextlib.asynccontextmanager
    async def admitted(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """One request RPC through the runtime's gate: ends the call UNAVAILABLE "draining" (retryable: nothing
        was done) once the worker drains; else counts it in flight until the block inside is left, however."""
        gate = self.runtime.gate
        if not gate.enter():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.runtime.config.worker_id} is draining")
        try:
            yield
        finally:
            gate.exit()

    async def Health(
        self, request: serving_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.HealthResponse:
        return self.runtime.health()

    async def GetLoad(self, request: serving_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> serving_pb2.LoadStats:
        return await self.runtime.load_stats()

    async def Abort(self, request: serving_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> serving_pb2.AbortResponse:
        return serving_pb2.AbortResponse(found=await self.runtime.abort(request.request_id))

    async def FetchBlocks(self, request: serving_pb2.FetchBlocksRequest,
                          context: grpc.aio.ServicerContext) -> serving_pb2.FetchBlocksResponse:
        # Not behind the drain gate: like a KV handoff, a draining worker still serves what it holds.
        return await self.runtime.peer.serve(request, context)

    async def ResetPrefixCache(self, request: serving_pb2.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext) -> serving_pb2.ResetPrefixCacheResponse:
        # Between steps, as a command: the index hears AllBlocksCleared right after (EngineLoop._run_commands).
        reset, used = await self.runtime.call(lambda e: (e.reset_prefix_cache(), e.block_pool.num_used_blocks))
        return serving_pb2.ResetPrefixCacheResponse(reset=reset, kv_blocks_used=used)

    async def LoadLoRAAdapter(self, request: serving_pb2.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> serving_pb2.LoRAAdapterResponse:
        loras = await self._loras(context)
        try:  # reads the files and moves the weights to the device: off the event loop; the engine steps on
            adapter = await asyncio.to_thread(loras.load, request.lora_name, request.lora_path)
        except (ValueError, OSError) as exc:  # LoRAError included; an unreadable file
            taken = request.lora_name in {a.name for a in loras.adapters()}
            await context.abort(grpc.StatusCode.ALREADY_EXISTS if taken else grpc.StatusCode.INVALID_ARGUMENT,
                                str(exc))
        except RuntimeError as exc:  # e.g. the device out of memory
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"LoRA adapter {request.lora_name!r}: {exc}")
        logger.info("loaded LoRA adapter %r from %s (%s)", adapter.name, adapter.path, adapter.digest)
        reply = serving_pb2.LoRAAdapter(name=adapter.name, digest=adapter.digest, path=adapter.path)
        return serving_pb2.LoRAAdapterResponse(adapter=reply)

    async def UnloadLoRAAdapter(self, request: serving_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> serving_pb2.LoRAAdapterResponse:
        loras = await self._loras(context)
        try:
            loras.unload(request.lora_name)
        except LoRAError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        logger.info("unloaded LoRA adapter %r", request.lora_name)
        return serving_pb2.LoRAAdapterResponse()

    async def _loras(self, context: grpc.aio.ServicerContext) -> LoRARegistry:
        loras = self.runtime.engine.loras
        if loras is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.runtime.config.worker_id} serves no LoRA adapters (--enable-lora)")
        assert loras is not None
        return loras


def makes_slowly(engine: LLMEngine, params: SamplingParams, request: serving_pb2.GenerateRequest) -> bool:
    """Whether making the request may take long enough to hold the event loop up: a grammar to compile, or a LoRA
    adapter to read from its files again (--max-cpu-loras evicted it)."""
    loras = engine.loras
    return params.structured_outputs is not None or bool(
        request.lora_name and loras is not None and not loras.resident(request.lora_name))


def check_adapter(request: Request, wanted: serving_pb2.GenerateRequest) -> None:
    """LoRAError unless `request` runs under the very adapter the router routed it for (`lora_digest`): one loaded
    again from other files under the same name since the router's last poll must not compute (and cache) its KV."""
    adapter = request.lora
    digest = getattr(adapter, "digest", None)
    if wanted.lora_digest and digest != wanted.lora_digest:
        raise LoRAError(f"LoRA adapter {wanted.lora_name!r} here is {digest}, not {wanted.lora_digest} as the router "
                        "saw it: loaded again since")


def chosen_k_counts(stats: EngineStats, spec: SpeculativeConfig | dict | None) -> list[int]:
    """How often the speculation policy chose each k in 0..num_speculative_tokens (LoadStats' dense form of
    `stats.spec_decode_chosen_k`); empty without speculative decoding."""
    if not isinstance(spec, SpeculativeConfig):  # None, or a dict EngineConfig has already turned into one
        return []
    return [stats.spec_decode_chosen_k.get(k, 0) for k in range(spec.num_speculative_tokens + 1)]


def _inject_slow_steps(engine: LLMEngine, sleep_s: float) -> None:
    if sleep_s <= 0:
        return
    logger.warning("%s=%g: every engine step sleeps that long first (fault injection)", FAULT_STEP_SLEEP_ENV, sleep_s)
    step = engine.step

    def slow_step() -> list[RequestOutput]:
        time.sleep(sleep_s)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
