"""The decode worker (role "decode"), or a worker that runs both phases itself (role "colocated").

One `Generate` stream, disaggregated (`prefill_endpoint` set):

    validate ──▶ reserve blocks for the prompt (waits while the pool is full, up to the transfer timeout)
      ──▶ Prefill RPC to the prefill worker, which pushes the prompt's KV into the reservation (receive KV)
      ──▶ commit: prompt marked computed, first token appended, request WAITING ──▶ RUNNING (continuous batching)
      ──▶ stream every step's tokens ──▶ finished: blocks freed by the engine

Colocated (no `prefill_endpoint`): the request is queued whole and this worker's engine prefills it too.

A failure of the prefill side (its worker unreachable, the KV handoff cut or timed out) ends the stream with
ABORTED before any token, which the router retries at once under the same request id; the request itself was
fine. The status names why (kv_transfer/handoff_failure.py), and goes out only once this attempt is gone from the
worker (`_let_go`), so that the retry meets nothing of it.

Every exit frees the blocks exactly once: a finished request through the engine; a refused, failed or timed-out
handoff through `_let_go`, a cancelled stream or a client that went away through `_abandon` (both cancel the
reservation first, so no late block write can land, then abort the request in the engine; `_let_go` waits for it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

import grpc
import grpc.aio

from engine.core.request import Request
from engine.llm_engine import LLMEngine
from engine.loader.checkpoint import Checkpoint
from engine.outputs import RemoteReservation, RequestOutput
from engine.request.lora import LoRAError
from engine.request.wire import logprobs_from_proto, sampling_params_from_proto
from kv_transfer.handoff_failure import REASON_KEY, REASONS
from kv_transfer.reservation import Reservation, ReservationState
from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import aio_channel
from worker.admissions import Admission
from worker.config import WorkerConfig
from worker.convert import output_to_response
from worker.engine_loop import EngineLoopClosed
from worker.peer_fetch import NOTHING
from worker.runtime import CALLER_OPTIONS, RuntimeWorker, WorkerRuntime, WorkerServicer, check_adapter, makes_slowly

logger = logging.getLogger(__name__)

RESERVE_POLL_S = 0.01
LANE_REPORT_S = 10.0  # how long a committed Prefill reply waits for the child ranks' reports of their lanes
LANE_REPORT_POLL_S = 0.002
# Why a failed Prefill call left the request without KV (kv_transfer/handoff_failure.py); else prefill_failed.
_PREFILL_CALL_FAILURES = {
    grpc.StatusCode.UNAVAILABLE: "prefill_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "prefill_timeout",
}


class GenerateFailed(Exception):
    """A request that cannot go on; `code` is the gRPC status the stream ends with, `handoff_failure` (ABORTED
    only) why it got no KV, one of kv_transfer/handoff_failure.py's REASONS, for the gateway's metrics."""

    def __init__(self, code: grpc.StatusCode, message: str, *, handoff_failure: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.handoff_failure = handoff_failure

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REASON_KEY, self.handoff_failure),) if self.handoff_failure else ()


class DecodeWorker(RuntimeWorker):
    def __init__(self, config: WorkerConfig, checkpoint: Checkpoint | None = None) -> None:
        if config.role not in ("decode", "colocated"):
            raise ValueError(f"DecodeWorker needs role 'decode' or 'colocated', got {config.role!r}")
        self.config = config
        self.runtime = WorkerRuntime(config, checkpoint)
        self.sink = self.runtime.sink  # its KVReceiver's: handoffs (role decode) and peer fetches
        serving_pb2_grpc.add_WorkerServicer_to_server(DecodeServicer(self), self.runtime.server)
        self._prefill_stubs: dict[str, serving_pb2_grpc.WorkerStub] = {}
        self._prefill_channels: list[grpc.aio.Channel] = []

    def stop(self) -> None:
        self.runtime.stop(before_loop_stops=self._close_channels)

    # -- one request -----------------------------------------------------------------------------------------
    async def generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        """The token stream of one request. Cancelled (the client left) at any await: the `finally` frees
        everything the request holds."""
        arrival_s = time.monotonic()
        runtime = self.runtime
        request_id = request.request_id
        params = sampling_params_from_proto(request.params)
        try:
            make = functools.partial(runtime.engine.make_request, request_id, list(request.prompt_token_ids), params,
                                     lora_name=request.lora_name or None)
            # A grammar compiles in make_request (up to a second), an evicted adapter is read again: off the event
            # loop, which serves every stream.
            req = await asyncio.to_thread(make) if makes_slowly(runtime.engine, params, request) else make()
            check_adapter(req, request)
        except LoRAError as exc:  # not the adapter the router saw here: another worker may serve it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        num_choices = params.num_sequences  # n > 1: one stream, each message tagged with its choice
        outputs = runtime.outputs(request_id, num_choices)
        timings = serving_pb2.StageTimings(router_queue_s=request.router_queue_s)
        reservation: Reservation | None = None
        fetched = NOTHING  # blocks fetched from a peer for a prefill here, staged until the request ends
        finished = False
        released = False  # let go of before its status went out (a failure before its first token)
        num_left = num_choices
        num_completion_tokens = 0
        first = True  # the first message carries the stage timings
        prompt_logprobs: list[serving_pb2.TokenLogprobs] = []  # disaggregated: computed by the prefill worker
        admission = runtime.admissions.enter()  # a waiting request in load reports until the engine holds it
        try:
            if request.prefill_endpoint:
                reservation = await self._reserve(req, request.prefill_endpoint, admission)
                timings.decode_queue_s = time.monotonic() - arrival_s
                early, prompt_logprobs = await self._prefill_remote(req, request, reservation, timings)
                if early is not None:  # the first token ended it on the prefill worker: no KV came
                    early.timings.CopyFrom(timings)
                    if num_choices == 1:
                        self._abandon(req, reservation)
                        finished = True
                        yield early
                        return
                    # The other choices compute the prompt here (no KV came for them to share).
                    await self._cancel(reservation, "choice 0 ended on the prefill worker")
                    await runtime.call(lambda e: e.prefill_choices_here(request_id))
                    num_left -= 1
                    num_completion_tokens += 1
                    early.usage.completion_tokens = num_completion_tokens
                    first = False
                    yield early
            else:
                if request.HasField("peer_fetch"):  # the prompt's head cached on a peer, cheaper fetched than computed
                    fetched = await runtime.peer.fetch(req, request.peer_fetch)
                    timings.peer_fetch_s, timings.peer_fetch_bytes = fetched.seconds, fetched.num_bytes
                try:
                    await runtime.call(admission.then(lambda e: e.enqueue(req)))
                except ValueError as exc:
                    raise GenerateFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            while num_left:
                out = await outputs.get()
                msg = output_to_response(out)
                if first:
                    first = False
                    if not request.prefill_endpoint:  # colocated: both prefill stages ran here
                        timings.prefill_queue_s = max(_queue_s(req) - fetched.seconds, 0.0)
                        timings.prefill_s = max(_first_token_s(req) - _queue_s(req), 0.0)
                    msg.timings.CopyFrom(timings)
                if prompt_logprobs and out.index == 0:
                    msg.prompt_logprobs.extend(prompt_logprobs)
                    prompt_logprobs = []
                if out.finished:
                    num_left -= 1
                    num_completion_tokens += len(out.token_ids)
                    msg.usage.completion_tokens = num_completion_tokens  # every choice so far; the prompt once
                finished = not num_left
                yield msg
        except GenerateFailed as exc:
            # The router retries a failed attempt at once, under the same request id, maybe to this very worker:
            # let go of this attempt before the status tells it so (gRPC sends the status inside `abort`, before
            # the `finally` below runs). Were the engine's abort still queued when the retry's stream starts
            # listening, this attempt's final "abort" output would end the retry's stream.
            await self._let_go(req, reservation, num_choices)
            released = True  # and nothing more of this attempt may touch the id, which the retry may hold by now
            await context.abort(exc.code, str(exc), exc.trailing_metadata)
        finally:
            admission.leave()
            runtime.peer.release(fetched)
            if not released:
                runtime.unlisten(request_id, num_choices)
                if not finished:
                    self._abandon(req, reservation)
                self.sink.remove(request_id)

    async def _reserve(self, req: Request, prefill_endpoint: str, admission: Admission) -> Reservation:
        """Blocks for the request to start, waiting while the pool is full (decode queue; `admission` counts it
        as waiting until it has its blocks). Registers the reservation, which accepts one handoff: from
        `prefill_endpoint`, under a fresh random transfer id."""
        runtime = self.runtime
        deadline = time.monotonic() + self.config.kv_transfer_timeout_s

        def reserve(engine: LLMEngine, preempt: bool = False) -> RemoteReservation | None:
            reserved = engine.reserve_remote(req, preempt=preempt)
            if reserved is not None:
                admission.leave()  # held by the engine from here (num_requests_receiving_kv)
            return reserved

        # Lower-priority running requests may make room, between steps (with async scheduling the step in flight is
        # read first, and only when preempting makes room: LLMEngine.reserve_remote).
        may_preempt = runtime.engine.config.scheduling_policy == "priority"
        while True:
            try:  # while a step computes: a decode step need not end first (EngineLoop.call_now)
                reserved = await runtime.call_now(reserve)
                if reserved is None and may_preempt:
                    reserved = await runtime.call(functools.partial(reserve, preempt=True))
            except ValueError as exc:
                raise GenerateFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if reserved is not None:
                break
            if time.monotonic() > deadline:
                raise GenerateFailed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no room in the KV cache for a {req.num_prompt_tokens}-token prompt within "
                    f"{self.config.kv_transfer_timeout_s:.0f}s",
                )
            await asyncio.sleep(RESERVE_POLL_S)
        blocks = runtime.engine.kv_blocks
        reservation = Reservation(
            req.request_id, req.num_prompt_tokens, reserved.block_ids, blocks.kv_cache, runtime.layout,
            first_block=reserved.num_held_blocks, transfer_id=secrets.token_hex(16), source_endpoint=prefill_endpoint,
            kv_scales=blocks.kv_scales, ranks=blocks.ranks, lanes=runtime.lanes,
        )
        self.sink.add(reservation)
        return reservation

    async def _prefill_remote(
        self,
        req: Request,
        request: serving_pb2.GenerateRequest,
        reservation: Reservation,
        timings: serving_pb2.StageTimings,
    ) -> tuple[serving_pb2.GenerateResponse | None, list[serving_pb2.TokenLogprobs]]:
        """Ask the prefill worker for the prompt and its KV; commit. Returns a final message if the request (its
        choice 0) ended on its first token, and the prompt logprobs the prefill worker computed, if asked for;
        raises GenerateFailed on any failure (the caller frees the reservation). Cancelling this coroutine (the
        client left) cancels the Prefill call, and the prefill worker aborts too."""
        stub = self._prefill_stub(request.prefill_endpoint)
        try:
            reply: serving_pb2.PrefillResponse = await stub.Prefill(
                serving_pb2.PrefillRequest(
                    request=request,
                    decode_endpoint=self.runtime.endpoint,
                    decode_worker_id=self.config.worker_id,
                    transfer_id=reservation.transfer_id,
                    decode_cached_blocks=reservation.first_block,
                    decode_tensor_parallel_size=self.runtime.layout.tensor_parallel_size,
                    decode_rank_endpoints=self.runtime.rank_endpoints,
                ),
                # The prefill worker's own queue plus the handoff: generous, but never unbounded.
                timeout=self.config.kv_transfer_timeout_s * 2,
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise GenerateFailed(code, exc.details() or "") from None
            raise GenerateFailed(
                grpc.StatusCode.ABORTED,
                f"prefill worker {request.prefill_endpoint} failed ({code.name}): {exc.details()}",
                handoff_failure=_PREFILL_CALL_FAILURES.get(code, "prefill_failed"),
            ) from None
        timings.prefill_queue_s = reply.timings.prefill_queue_s
        timings.prefill_s = reply.timings.prefill_s
        timings.kv_transfer_s = reply.timings.kv_transfer_s
        timings.kv_transfer_bytes = reply.timings.kv_transfer_bytes
        timings.peer_fetch_s = reply.timings.peer_fetch_s
        timings.peer_fetch_bytes = reply.timings.peer_fetch_bytes
        if reply.error:  # the prompt ran but its KV never arrived: this pair failed, not the request
            raise GenerateFailed(grpc.StatusCode.ABORTED, reply.error,
                                 handoff_failure=reply.error_reason if reply.error_reason in REASONS else "")
        prompt_logprobs = list(reply.prompt_logprobs)
        if reply.finish_reason:
            return serving_pb2.GenerateResponse(
                request_id=req.request_id,
                token_ids=[reply.first_token_id],
                text_delta=reply.text,
                logprobs=[reply.first_logprobs] if reply.HasField("first_logprobs") else [],
                finish_reason=reply.finish_reason,
                stop_reason=reply.stop_reason,
                usage=serving_pb2.Usage(
                    prompt_tokens=req.num_prompt_tokens, completion_tokens=1, cached_tokens=reply.num_cached_tokens
                ),
                prompt_logprobs=prompt_logprobs,
            ), []
        # The sender returns only after the receiver committed, so anything else is a protocol error. Lanes to child
        # ranks commit there and reach this reservation through a pipe, which may trail the Prefill reply a little.
        waited_until = time.monotonic() + LANE_REPORT_S
        while reservation.state is ReservationState.RECEIVING and time.monotonic() < waited_until:
            await asyncio.sleep(LANE_REPORT_POLL_S)
        if reservation.state is not ReservationState.COMMITTED:
            raise GenerateFailed(
                grpc.StatusCode.INTERNAL,
                f"prefill worker replied but the KV handoff is {reservation.state.value}: {reservation.error or ''}",
            )
        self.runtime.transfers.record(reservation.num_bytes, reply.timings.kv_transfer_s)
        first_logprobs = logprobs_from_proto(reply.first_logprobs) if reply.HasField("first_logprobs") else None
        await self.runtime.call_now(  # its first token out at once, its first decode in the next step
            lambda e: e.commit_remote(req.request_id, reply.first_token_id, first_logprobs, reply.num_cached_tokens)
        )
        return None, prompt_logprobs

    async def _let_go(self, req: Request, reservation: Reservation | None, num_choices: int) -> None:
        """What the stream's `finally` does for an unfinished request, and wait until the engine has aborted it:
        once this returns, nothing of the request is left on this worker (no listener, no reservation, no request
        in the engine), so another request of the same id starts afresh."""
        self.runtime.unlisten(req.request_id, num_choices)
        self.sink.remove(req.request_id)
        aborted = self._abandon(req, reservation, why="request failed before its first token")
        if aborted is not None:
            await asyncio.wrap_future(aborted)

    def _abandon(
        self, req: Request, reservation: Reservation | None, why: str = "request abandoned"
    ) -> Future[list[RequestOutput]] | None:
        """Free what the request holds, without waiting (this runs on the asyncio loop, maybe cancelled): the
        reservation now, the engine's abort as a command; its future, or None when the engine loop has stopped
        (its stop() aborted everything already)."""
        def abort() -> Future[list[RequestOutput]] | None:
            try:
                return self.runtime.loop.submit(lambda e: e.abort_request([req.request_id]))
            except EngineLoopClosed:
                logger.warning("could not abort %s: engine loop stopped", req.request_id)
                return None

        if reservation is None or not reservation.cancels_later:
            if reservation is not None:
                reservation.cancel(why)  # after this no block write is in flight
            return abort()
        # At TP > 1 the child ranks confirm first (a round trip, never on this loop); the blocks go after.
        aborted: Future[list[RequestOutput]] = Future()

        def then() -> None:
            inner = abort()
            if inner is None:
                aborted.set_result([])
            else:
                inner.add_done_callback(lambda f: aborted.set_exception(f.exception()) if f.exception() is not None
                                        else aborted.set_result(f.result()))

        reservation.fail_later(why, then=then)
        return aborted

    async def _cancel(self, reservation: Reservation, why: str) -> None:
        """`reservation.cancel`, its round trip to the child ranks (TP > 1) awaited off this loop."""
        if not reservation.cancels_later:
            reservation.cancel(why)
            return
        quiet: Future[None] = Future()
        reservation.fail_later(why, then=lambda: quiet.set_result(None))
        await asyncio.wrap_future(quiet)

    def _prefill_stub(self, endpoint: str) -> serving_pb2_grpc.WorkerStub:
        """An aio stub on this worker's asyncio loop (only called there, so no lock)."""
        stub = self._prefill_stubs.get(endpoint)
        if stub is None:
            channel = aio_channel(endpoint, self.config.auth, options=CALLER_OPTIONS)
            self._prefill_channels.append(channel)
            stub = self._prefill_stubs[endpoint] = serving_pb2_grpc.WorkerStub(channel)
        return stub

    async def _close_channels(self) -> None:
        for channel in self._prefill_channels:
            await channel.close()


def _queue_s(req: Request) -> float:
    t = req.times
    return (t.first_scheduled_s - t.arrival_s) if t.first_scheduled_s is not None else 0.0


def _first_token_s(req: Request) -> float:
    t = req.times
    return (t.first_token_s - t.arrival_s) if t.first_token_s is not None else 0.0


class DecodeServicer(WorkerServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        super().__init__(worker.runtime)
        self.worker = worker

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        # An async generator function itself: that is how grpc.aio tells a streaming handler from a unary one.
        async with self.admitted(context):
            async for message in self.worker.generate(request, context):
                yield message

    async def Prefill(self, request: serving_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a decode worker does not serve Prefill")
