"""The prefill worker. Role policy only: the engine, its loop and the gRPC server come from WorkerRuntime.

One `Prefill` call, from a decode worker that has already reserved blocks for the prompt:

    queue the prompt (remote_decode) ──▶ continuous batching of prompts, chunked prefill ──▶ first token sampled
      ├─ the first token ends the request (EOS, stop, max_tokens=1): reply with it; no KV moves
      └─ otherwise the engine holds the request's blocks (PREFILLED) ──▶ KVSender.send to the decode worker
           ──▶ receiver confirms (or the send fails / times out) ──▶ release the blocks (full ones stay as
           prefix cache) ──▶ reply with the first token and the stage timings

Ownership passes explicitly: the blocks are freed only after `send` returned or raised, and `send` returns only
once the receiver verified every block; a send never outlives `kv_transfer_timeout_s`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence

import grpc
import grpc.aio
import torch

from engine.core.request import Request
from engine.loader.checkpoint import Checkpoint
from engine.outputs import RequestOutput
from engine.request.lora import LoRAError
from engine.request.wire import logprobs_to_proto, sampling_params_from_proto, stop_reason_to_proto
from kv_transfer.base import KVBlockSource, TransferResult
from kv_transfer.handoff_failure import reason_of
from kv_transfer.layout import KVHandoff, KVLayout, KVTransferError
from kv_transfer.tp_plan import WirePlan, wire_plan
from kv_transfer.rank_lanes import LANE_TRANSPORTS, send_lanes
from kv_transfer.tp_slices import RankCache, WireBlocks, rank_caches
from protos import serving_pb2, serving_pb2_grpc
from worker.config import WorkerConfig
from worker.peer_fetch import NOTHING, Fetched
from worker.stall_fault import StallHalfWay
from worker.runtime import RuntimeWorker, WorkerRuntime, WorkerServicer, check_adapter, makes_slowly

logger = logging.getLogger(__name__)

# Fault injection for the cluster tests (like the conformance suite's TransferFault, but reachable through
# `splitserve serve`): the first N handoffs of two or more blocks are cut half-way, the source failing mid-send.
FAULT_KV_CUTS_ENV = "SPLITSERVE_FAULT_KV_CUTS"
# And while the file this names exists, a handoff of two or more blocks stalls half-way (StallHalfWay), so that a
# test can kill the worker mid-handoff.
FAULT_KV_STALL_ENV = "SPLITSERVE_FAULT_KV_STALL_FILE"
# And at runtime: each time the file this names exists when a handoff of two or more blocks starts, that handoff is
# cut half-way and the file removed (one cut per file created: bench/chaos.py's "cut a KV transfer" fault).
FAULT_KV_CUT_FILE_ENV = "SPLITSERVE_FAULT_KV_CUT_FILE"


class HeldBlocks(WireBlocks):
    """A KVBlockSource over a prefilled request's held blocks (read-only while held), in the wire blocks of a handoff
    (`plan`: `handoff.wire`; default: whole blocks of a tensor-parallel size 1 engine). At tensor_parallel_size N
    `ranks` is every rank's cache (`KVBlocks.ranks`), each wire block read from the rank whose KV heads it carries.

    A wire block is a strided view of the cache (an int8 one packs its values and scales into one byte tensor,
    kv_transfer/wire_block.py), gathered by the transport as it copies it out: the gRPC sender does it in the same
    pass that checksums and frames it."""

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], layout: KVLayout,
                 kv_scales: torch.Tensor | None = None, *,
                 ranks: Sequence[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
                 plan: WirePlan | None = None) -> None:
        super().__init__(rank_caches(layout, ranks or ((kv_cache, kv_scales),)), block_ids,
                         plan or wire_plan(layout, layout), sender=True)


class CutHalfWay:
    """A KVBlockSource that fails after half of its blocks: the sender gives up and the receiver must fail the
    handoff with half the blocks written."""

    def __init__(self, source: HeldBlocks, handoff: KVHandoff) -> None:
        self.source = source
        self.cut_at = handoff.first_wire_block + len(handoff.wire_indices) // 2

    def read_block(self, index: int) -> torch.Tensor:
        if index >= self.cut_at:
            raise KVTransferError(f"{FAULT_KV_CUTS_ENV}: handoff cut after {self.cut_at} blocks")
        return self.source.read_block(index)


class PrefillWorker(RuntimeWorker):
    def __init__(self, config: WorkerConfig, checkpoint: Checkpoint | None = None) -> None:
        if config.role != "prefill":
            raise ValueError(f"PrefillWorker needs role 'prefill', got {config.role!r}")
        self.config = config
        self.runtime = WorkerRuntime(config, checkpoint)
        self.sender = self.runtime.sender()
        self._cuts_left = int(os.environ.get(FAULT_KV_CUTS_ENV, "0") or 0)
        self._cuts_lock = threading.Lock()
        serving_pb2_grpc.add_WorkerServicer_to_server(PrefillServicer(self), self.runtime.server)

    def stop(self) -> None:
        self.runtime.stop()  # and its sender

    async def prefill(
        self, request: serving_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.PrefillResponse:
        gen = request.request
        request_id = gen.request_id
        runtime = self.runtime
        try:
            params = sampling_params_from_proto(gen.params)
            make = functools.partial(runtime.engine.make_request, request_id, list(gen.prompt_token_ids), params,
                                     remote_decode=True, lora_name=gen.lora_name or None)
            # A grammar compiles in make_request (up to a second), an evicted adapter is read again: off the event
            # loop, which serves every call.
            req = await asyncio.to_thread(make) if makes_slowly(runtime.engine, params, gen) else make()
            check_adapter(req, gen)
        except LoRAError as exc:  # not the adapter the router saw here: another worker may serve it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # The prompt's block table is read on the engine thread as its prefill finishes. Asked for later, from the
        # send's executor thread, it waits for the next step to end: with prompts queued that step starts at once,
        # and the handoff (so this request's first token) waited a whole prefill step (docs/benchmarks.md,
        # "Pass 12").
        held: list[list[int]] = []

        def read_held(out: RequestOutput) -> None:
            if out.finished and out.finish_reason == "prefilled":
                held.append(runtime.engine.held_block_ids(request_id))

        outputs = runtime.outputs(request_id, on_engine_thread=read_held)
        admission = runtime.admissions.enter()  # a waiting request in load reports until the engine queues it
        done = False
        fetched = NOTHING
        try:
            # The router found the prompt's head cached on a peer and priced fetching it below computing it.
            fetched = await runtime.peer.fetch(req, gen.peer_fetch) if gen.HasField("peer_fetch") else NOTHING
            try:
                await runtime.call(admission.then(lambda e: e.enqueue(req)))
            except ValueError as exc:
                done = True  # nothing was queued
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            out = await outputs.get()
            while not out.finished:  # a prefill's only output is its first token, which finishes it here
                out = await outputs.get()
            reply = self._reply(request_id, out, fetched)
            if out.finish_reason != "prefilled":  # ended on its first token, or failed: nothing to hand off
                done = True
                return reply
            try:
                if not held:  # no longer held as its prefill finished (read_held's error is logged)
                    raise KeyError(f"request {request_id!r} holds no KV blocks")
                # The send blocks (its transport's own threads and sockets): on the loop's executor, not on it.
                result = await asyncio.to_thread(self._hand_off, req, request, held[0])
            except (KVTransferError, KeyError) as exc:  # KeyError: aborted meanwhile, its blocks already released
                self.runtime.transfers.record_failure()
                logger.warning("KV handoff of %s to %s failed: %s", request_id, request.decode_endpoint, exc)
                reply.finish_reason = "error"
                reply.error = f"KV transfer to the decode worker failed: {exc}"
                reply.error_reason = reason_of(exc)
                return reply
            finally:
                done = True
                runtime.loop.submit(lambda e: e.release_held(request_id))
            reply.timings.kv_transfer_s = result.seconds
            reply.timings.kv_transfer_bytes = result.num_bytes
            return reply
        finally:
            admission.leave()
            runtime.peer.release(fetched)
            runtime.loop.unlisten(request_id)
            if not done:  # the decode worker gave up (its client left, or it timed out): abort, held blocks too
                runtime.loop.submit(lambda e: e.abort_request([request_id]))

    @staticmethod
    def _reply(request_id: str, out: RequestOutput, fetched: Fetched = NOTHING) -> serving_pb2.PrefillResponse:
        stats = out.stats
        reply = serving_pb2.PrefillResponse(
            request_id=request_id,
            num_cached_tokens=stats.num_cached_tokens if stats else 0,
            timings=serving_pb2.StageTimings(
                # A peer fetch ran between the request's arrival and its queueing: its own stage, not queue time.
                prefill_queue_s=max(stats.queue_time_s - fetched.seconds, 0.0) if stats else 0.0,
                prefill_s=(stats.ttft_s - stats.queue_time_s) if stats else 0.0,
                peer_fetch_s=fetched.seconds,
                peer_fetch_bytes=fetched.num_bytes,
            ),
        )
        if out.token_ids:
            reply.first_token_id = out.token_ids[0]
        if out.logprobs:
            reply.first_logprobs.CopyFrom(logprobs_to_proto(out.logprobs[0]))
        if out.prompt_logprobs:
            reply.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in out.prompt_logprobs)
        if out.finish_reason != "prefilled":
            reply.finish_reason = out.finish_reason or "error"
            if out.stop_reason is not None:
                reply.stop_reason.CopyFrom(stop_reason_to_proto(out.stop_reason))
            reply.text = out.text
            reply.error = out.error or ""
        return reply

    def _hand_off(self, req: Request, request: serving_pb2.PrefillRequest, block_ids: list[int]) -> TransferResult:
        """Send the held blocks `block_ids` to the decode worker; blocks until the receiver confirmed or the send
        failed."""
        runtime = self.runtime
        layout = runtime.layout
        handoff = KVHandoff(
            request_id=req.request_id,
            transfer_id=request.transfer_id or uuid.uuid4().hex,
            num_tokens=req.num_prompt_tokens,
            layout=layout,
            block_hashes=tuple(req.block_hashes[: req.num_prompt_tokens // layout.block_size]),
            source_endpoint=runtime.endpoint,
            source_worker_id=self.config.worker_id,
            transport=self.config.kv_transport,
            first_block=request.decode_cached_blocks,  # the decode worker holds these already
            receiver_tensor_parallel_size=request.decode_tensor_parallel_size or 1,
        )
        blocks = runtime.engine.kv_blocks
        faults: list[Callable[[KVBlockSource, KVHandoff], KVBlockSource]] = []  # fault injection, in order
        if len(handoff.block_indices) >= 2 and self._take_cut():
            faults.append(CutHalfWay)
        stall_path = os.environ.get(FAULT_KV_STALL_ENV)
        if stall_path and len(handoff.block_indices) >= 2 and os.path.exists(stall_path):
            faults.append(functools.partial(StallHalfWay, path=stall_path))

        def wrap(source: KVBlockSource, handoff: KVHandoff) -> KVBlockSource:
            for fault in faults:
                source = fault(source, handoff)
            return source

        timeout_s = self.config.kv_transfer_timeout_s
        if request.decode_rank_endpoints and self.config.kv_transport in LANE_TRANSPORTS and (
                layout.tensor_parallel_size > 1 or handoff.receiver_tensor_parallel_size > 1):
            # rank to rank: each sender rank streams its own KV heads to each receiver rank's own endpoint
            own = RankCache(layout=layout, rank=0, kv_cache=blocks.kv_cache, kv_scales=blocks.kv_scales)
            result = send_lanes(handoff, own=own, block_ids=block_ids, endpoints=request.decode_rank_endpoints,
                                sender=self.sender, ranks=runtime.lanes, timeout_s=timeout_s, wrap=wrap)
        else:
            source = wrap(HeldBlocks(blocks.kv_cache, block_ids, layout, blocks.kv_scales, ranks=blocks.ranks,
                                     plan=handoff.wire), handoff)
            result = self.sender.send(handoff, source, endpoint=request.decode_endpoint, timeout_s=timeout_s)
        runtime.transfers.record(result.num_bytes, result.seconds)
        if logger.isEnabledFor(logging.DEBUG):  # where the handoff's time went (kv_transfer/stage_clock.py)
            logger.debug("KV handoff of %s to %s: %d bytes in %.3f ms (%s)", req.request_id, request.decode_endpoint,
                         result.num_bytes, result.seconds * 1e3,
                         ", ".join(f"{stage} {seconds * 1e3:.3f} ms" for stage, seconds in result.stages_s.items()))
        return result

    def _take_cut(self) -> bool:
        with self._cuts_lock:
            if self._cuts_left > 0:
                self._cuts_left -= 1
                return True
        cut_file = os.environ.get(FAULT_KV_CUT_FILE_ENV)
        if cut_file:
            try:
                os.unlink(cut_file)  # whichever worker removes it takes the cut
                return True
            except FileNotFoundError:
                pass
        return False


class PrefillServicer(WorkerServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        super().__init__(worker.runtime)
        self.worker = worker

    async def Prefill(
        self, request: serving_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.PrefillResponse:
        async with self.admitted(context):
            return await self.worker.prefill(request, context)

    async def Generate(self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "a prefill worker does not generate; send Generate to a decode worker")
