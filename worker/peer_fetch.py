"""Peer fetch: a worker about to compute a prompt's leading blocks that another live worker holds fetches them
instead, over its KV transport, with a handoff's checks. The router decides (router/peer_fetch.py: a fetch priced
against a recompute) and names the holder in the request (`GenerateRequest.peer_fetch`); any role fetches (the
prefill worker that runs a prompt, a decode worker prefilling locally, a colocated worker) and any role holds.

    fetcher (runs the prompt)                                    holder
    ─────────────────────────                                    ──────
    s = leading blocks it holds (device, tier, staged)
    reserve a staging buffer for blocks [s, n) ─FetchBlocks(hashes[:n], first_block=s)─▶ pin blocks [s, n) of its
                                                                 device prefix cache: all of them, or refuse
                                                                 (FAILED_PRECONDITION; nothing pinned)
                    ◀── a KV handoff: CRC-32C per block, bounded by --kv-transfer-timeout ── KVSender.send
                                                                 unpin, once the send returned or raised
    ◀── FetchBlocksResponse
    committed: stage the blocks in the engine (engine/kv_peer_blocks.py); the prompt's admission loads them as
    prefix hits of tier "peer"; `release` unstages them when the request ends

A fetch never fails a request: refused (the blocks gone), timed out, a dead holder, a bad checksum — the fetcher
counts it by reason (`kv_peer_fetch_failures_total{reason}`) and computes the blocks as it would have. Nothing of a
failed fetch reaches the cache: its staging buffer is dropped with its reservation, which the receiver can no longer
write once cancelled. The holder's pins go back however the send ends, the worker's own process holding them (a
holder killed mid-fetch takes its pins with it; the fetcher's call fails within the timeout).

Tensor parallelism: a holder at any size sends, its wire plan cutting each block for a receiver of size 1; a fetcher
at any size stages whole blocks (every KV head: a layout of size 1), which its admission loads into every rank's
cache, each rank its heads (engine/kv_peer_blocks.py): through shared memory on cpu, CUDA IPC on cuda (rank 0's
copies synchronized before the ranks' next step: kv_transfer/whole_blocks.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import torch

from engine.core.request import Request
from kv_transfer.base import KVSender, TransferResult
from kv_transfer.block_hash import HASH_SIZE_BYTES, BlockHash
from kv_transfer.layout import KVHandoff, KVTransferError
from kv_transfer.reservation import Reservation, ReservationSink, ReservationState
from kv_transfer.tp_slices import WireBlocks, rank_caches
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import aio_channel
from worker.engine_loop import EngineLoopClosed
from worker.stall_fault import StallHalfWay

if TYPE_CHECKING:
    from worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

# Fault injection for the tests (like prefill_worker's SPLITSERVE_FAULT_KV_STALL_FILE): while the file this names
# exists, a holder's send of two blocks or more stalls before its second half, after writing "stalled <fetch id>"
# into the file, so that a test can kill the holder mid-fetch.
FAULT_STALL_ENV = "SPLITSERVE_FAULT_PEER_FETCH_STALL_FILE"

# Why a fetch failed (kv_peer_fetch_failures_total{reason}).
FAILURE_REASONS = ("gone", "timeout", "unavailable", "refused", "transfer")
_RPC_REASONS = {
    grpc.StatusCode.FAILED_PRECONDITION: "gone",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "unavailable",
    grpc.StatusCode.INVALID_ARGUMENT: "refused",
    grpc.StatusCode.UNIMPLEMENTED: "refused",
    grpc.StatusCode.UNAUTHENTICATED: "refused",
}


@dataclass(frozen=True)
class Fetched:
    """What one fetch staged in the engine (nothing: an empty tuple), for `release` once the request ends."""

    block_hashes: tuple[BlockHash, ...] = ()
    num_bytes: int = 0
    seconds: float = 0.0


NOTHING = Fetched()


class PeerFetcher:
    """A worker's two ends of peer fetch: `fetch` (on the asyncio loop) and `serve` (the FetchBlocks handler).
    `sink`: the worker's receiving sink (its KVReceiver serves it); `sender()`: its KV sender, made on first use."""

    def __init__(self, runtime: WorkerRuntime, sink: ReservationSink, sender: Callable[[], KVSender]) -> None:
        self.runtime = runtime
        self.sink = sink
        self._sender = sender
        self._stubs: dict[str, serving_pb2_grpc.WorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._lock = threading.Lock()  # the counters: read by GetLoad
        self.num_blocks = 0
        self.num_bytes = 0
        self.seconds = 0.0
        self.failures: collections.Counter[str] = collections.Counter()

    # -- the fetcher -----------------------------------------------------------------------------------------
    async def fetch(self, req: Request, plan: serving_pb2.PeerFetch) -> Fetched:
        """Fetch the leading blocks of `req`'s prompt that `plan`'s holder holds and this worker lacks, and stage
        them for the request's admission (call before queueing it). Never raises but for cancellation: a fetch
        that fails is counted and fetches nothing."""
        runtime = self.runtime
        layout = runtime.layout
        if not plan.endpoint or plan.endpoint == runtime.endpoint:
            return NOTHING
        if layout.tensor_parallel_size != 1 and not runtime.engine.peer_blocks.loads_every_rank:
            self._failed(req, plan, "refused", "at tensor_parallel_size > 1 a peer fetch stages whole blocks that "
                         "rank 0 loads into every rank's cache, and this engine's rank 0 does not map them")
            return NOTHING
        # Never the prompt's last token: the step that computes it samples the first output token.
        num_blocks = min(plan.num_blocks, (req.num_tokens - 1) // layout.block_size, len(req.block_hashes))
        hashes = tuple(req.block_hashes[:num_blocks])
        start = await runtime.call_now(lambda e: e.num_leading_blocks_held(hashes)) if hashes else 0
        if start >= num_blocks:
            return NOTHING
        fetch_id = f"peer-fetch-{secrets.token_hex(16)}"
        kv, scales = self._staging(num_blocks - start)
        whole = dataclasses.replace(layout, tensor_parallel_size=1)  # staged with every head, at any size
        reservation = Reservation(
            fetch_id, num_blocks * layout.block_size, [0] * start + list(range(num_blocks - start)), kv, whole,
            first_block=start, transfer_id=fetch_id, source_endpoint=plan.endpoint, kv_scales=scales)
        self.sink.add(reservation)
        began = time.monotonic()
        try:
            await self._stub(plan.endpoint).FetchBlocks(
                serving_pb2.FetchBlocksRequest(
                    fetch_id=fetch_id, block_hashes=list(hashes), first_block=start,
                    receiver_endpoint=runtime.endpoint, receiver_worker_id=runtime.config.worker_id),
                timeout=runtime.config.kv_transfer_timeout_s)
            if reservation.state is not ReservationState.COMMITTED:  # the holder's send returns after the commit
                raise KVTransferError(f"the holder replied, the fetch is {reservation.state.value}: "
                                      f"{reservation.error or ''}")
            staged = hashes[start:]
            await runtime.call_now(lambda e: e.stage_peer_blocks(staged, kv, scales))
        except grpc.aio.AioRpcError as exc:
            self._failed(req, plan, _RPC_REASONS.get(exc.code(), "transfer"), f"{exc.code().name}: {exc.details()}")
            return NOTHING
        except KVTransferError as exc:
            self._failed(req, plan, "transfer", str(exc))
            return NOTHING
        finally:
            reservation.cancel("peer fetch over")  # a no-op once committed; else no late write can land
            self.sink.remove(fetch_id)
        seconds = time.monotonic() - began
        with self._lock:
            self.num_blocks += len(staged)
            self.num_bytes += reservation.num_bytes
            self.seconds += seconds
        logger.debug("peer fetch for %s: blocks %d to %d from %s, %d bytes in %.3f ms", req.request_id, start,
                     num_blocks - 1, plan.worker_id or plan.endpoint, reservation.num_bytes, seconds * 1e3)
        return Fetched(block_hashes=staged, num_bytes=reservation.num_bytes, seconds=seconds)

    def release(self, fetched: Fetched) -> None:
        """Unstage what `fetch` staged (the request ended, however). Safe from any thread; a stopped engine
        dropped everything already."""
        if not fetched.block_hashes:
            return
        try:
            self.runtime.loop.submit(lambda e: e.unstage_peer_blocks(fetched.block_hashes))
        except EngineLoopClosed:
            pass

    def _staging(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A buffer of `num_blocks` whole blocks (every KV head, whatever the tensor-parallel size) in the cache's
        dtype (and its int8 scales), on its device."""
        blocks = self.runtime.engine.kv_blocks
        lay, cache = blocks.layout, blocks.kv_cache  # [num_layers, 2, num_blocks, block_size, local heads, head_dim]
        kv = torch.empty((lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim),
                         dtype=cache.dtype, device=cache.device)
        scales = None
        if blocks.kv_scales is not None:  # [num_layers, 2, num_blocks, num_kv_heads]
            s = blocks.kv_scales
            scales = torch.empty((lay.num_layers, 2, num_blocks, lay.num_kv_heads), dtype=s.dtype, device=s.device)
        return kv, scales

    def _failed(self, req: Request, plan: serving_pb2.PeerFetch, reason: str, detail: str) -> None:
        with self._lock:
            self.failures[reason] += 1
        logger.warning("peer fetch for %s from %s failed (%s: %s); computing its prefix instead", req.request_id,
                       plan.worker_id or plan.endpoint, reason, detail)

    def _stub(self, endpoint: str) -> serving_pb2_grpc.WorkerStub:
        """An aio stub on this worker's asyncio loop (only called there, so no lock)."""
        stub = self._stubs.get(endpoint)
        if stub is None:
            from worker.runtime import CALLER_OPTIONS  # the runtime imports this module

            channel = aio_channel(endpoint, self.runtime.config.auth, options=CALLER_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[endpoint] = serving_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        """Close the channels to holders (on the asyncio loop, before it stops)."""
        for channel in self._channels:
            await channel.close()

    def stats(self) -> tuple[int, int, float, dict[str, int]]:
        """(blocks fetched, bytes, seconds, failures by reason) so far."""
        with self._lock:
            return self.num_blocks, self.num_bytes, self.seconds, dict(self.failures)

    # -- the holder ------------------------------------------------------------------------------------------
    async def serve(self, request: serving_pb2.FetchBlocksRequest,
                    context: grpc.aio.ServicerContext) -> serving_pb2.FetchBlocksResponse:
        """Send blocks [first_block, n) of the named prefix to the fetcher's receiver, from this worker's device
        prefix cache, pinned meanwhile. FAILED_PRECONDITION when any of them is gone (nothing is sent); ABORTED
        when the send fails."""
        hashes = list(request.block_hashes)
        first = request.first_block
        if (not request.fetch_id or not request.receiver_endpoint or not first < len(hashes)
                or any(len(h) != HASH_SIZE_BYTES for h in hashes)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "FetchBlocks needs a fetch id, a receiver, and blocks after first_block")
        pin_id = request.fetch_id
        try:
            block_ids = await self.runtime.call_now(lambda e: e.pin_cached_blocks(pin_id, hashes[first:]))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if block_ids is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {self.runtime.config.worker_id} no longer holds blocks {first} to "
                                f"{len(hashes) - 1} of that prefix")
        try:
            # The send blocks (its transport's threads and sockets): off the loop. It unpins when it ends, not
            # when this call does: a cancelled call must not free blocks the send still reads.
            result = await asyncio.to_thread(self._send, request, hashes, block_ids)
        except KVTransferError as exc:
            logger.warning("peer fetch %s to %s failed: %s", pin_id, request.receiver_endpoint, exc)
            await context.abort(grpc.StatusCode.ABORTED, f"the KV send failed: {exc}")
        return serving_pb2.FetchBlocksResponse(num_blocks=len(hashes) - first, num_bytes=result.num_bytes,
                                               seconds=result.seconds)

    def _send(self, request: serving_pb2.FetchBlocksRequest, hashes: list[BlockHash],
              block_ids: list[int]) -> TransferResult:
        runtime = self.runtime
        try:
            layout = runtime.layout
            handoff = KVHandoff(
                request_id=request.fetch_id, transfer_id=request.fetch_id, num_tokens=len(hashes) * layout.block_size,
                layout=layout, block_hashes=tuple(hashes), source_endpoint=runtime.endpoint,
                source_worker_id=runtime.config.worker_id, transport=runtime.config.kv_transport,
                first_block=request.first_block, receiver_tensor_parallel_size=1)
            blocks = runtime.engine.kv_blocks
            source: WireBlocks | StallHalfWay = WireBlocks(
                rank_caches(layout, blocks.ranks or ((blocks.kv_cache, blocks.kv_scales),)),
                [0] * request.first_block + block_ids, handoff.wire, sender=True)
            stall_path = os.environ.get(FAULT_STALL_ENV)
            if stall_path and len(handoff.wire_indices) >= 2 and os.path.exists(stall_path):
                source = StallHalfWay(source, handoff, stall_path)
            return self._sender().send(handoff, source, endpoint=request.receiver_endpoint,
                                       timeout_s=runtime.config.kv_transfer_timeout_s)
        finally:
            try:
                runtime.loop.submit(lambda e: e.unpin_blocks(request.fetch_id))
            except EngineLoopClosed:
                pass  # stopping: the pool goes with the engine

