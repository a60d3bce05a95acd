"""One request's trip to the workers: admit it, route it, call the target's Generate, hand back the open stream.

    Dispatcher.open(job) ──admission (router/admission.py: wait in the queue, or 429)──▶ ticket
                         ──prefix index lookup (prefix-aware policy; one Redis round trip)──▶ overlaps
                         ──plan_route──▶ GenerateRequest(prefill_endpoint: the prefill worker; "" colocated, or a
                                         local prefill on the decode worker) ──▶ provisional index entries
                         ──stub.Generate──▶ first message arrived? ── yes ──▶ GenerationStream
                                                │ UNAVAILABLE before any message: mark the worker unhealthy,
                                                │ try another worker; ABORTED (the KV handoff failed): try
                                                └─ again, another prefill worker if any (max_dispatch_attempts)

After the first message, a worker lost mid-stream is router/resumable_stream.py's business: it calls `resume`,
which dispatches the resumed request the same way (no admission: the request keeps its ticket).

Opening waits for the first message so that a request failing before any token (bad argument, no capacity,
worker down) still gets a proper HTTP status, even when streaming.

GenerationStream lifecycle: `read()` until a message carries a finish_reason; then, always, `close()`, which also
gives the request's admission ticket back (so the next queued request may go). Closing a stream that did not finish (the client went away, the handler was cancelled, an error) cancels the gRPC call —
the decode worker aborts on cancellation and tells its prefill worker — and also sends `Abort(request_id)` to
the worker as a belt-and-braces, in the background.
"""

from __future__ import annotations

import asyncio
import dataclasses

import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from engine.request.sampling_params import SamplingParams
from engine.request.wire import sampling_params_to_proto
from kv_transfer import handoff_failure
from protos import serving_pb2
from router.admission import Admission, AdmissionRefused, Ticket
from router.config import RouterConfig
from router.errors import ApiError
from router.inflight_prefixes import InflightEntry, InflightPrefixes, wait_for_inflight
from router.metrics import RequestTracker
from router.peer_fetch import PeerFetchPlan, PeerFetchRates, fetch_pricer, price_peer_fetch
from router.prefix_routing import PrefixIndex, PrefixLookup
from router.routing import LoRATarget, NoWorkerError, Route, WorkerLoad, num_blocks_needed, plan_route
from router.worker_registry import WorkerRegistry

logger = logging.getLogger(__name__)

FINISHED = ("stop", "length")  # finish reasons of a request that succeeded

# gRPC status -> (HTTP status, failure reason for metrics)
_RPC_ERRORS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "bad_request"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "bad_request"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "unavailable"),
    grpc.StatusCode.UNAVAILABLE: (503, "unavailable"),
    grpc.StatusCode.CANCELLED: (503, "unavailable"),
    # The prefill side failed the request on every attempt; counted by why (api_error_from_rpc).
    grpc.StatusCode.ABORTED: (503, handoff_failure.UNNAMED),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    # The worker does not hold the LoRA adapter the router saw it serve (unloaded, or reloaded from other files).
    grpc.StatusCode.FAILED_PRECONDITION: (503, "lora_adapter"),
}


# Failures before any token that another attempt may not meet: UNAVAILABLE (the target worker is unreachable),
# ABORTED (the decode worker got no KV from the prefill side: prefill worker down, handoff cut or timed out) and
# FAILED_PRECONDITION (the target no longer holds the request's LoRA adapter).
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION)


def _blamed_worker(code: grpc.StatusCode, route: Route, loads: Sequence[WorkerLoad]) -> str | None:
    """The worker the next attempt avoids: the unreachable target, or after a failed handoff the prefill worker
    if another one can take its place (with a single prefill worker, the retry goes to the same pair)."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
        return route.target.worker_id
    if route.prefill is None:
        return None
    others = [load for load in loads if load.role == "prefill" and load.worker_id != route.prefill.worker_id]
    return route.prefill.worker_id if others else None


@dataclass(frozen=True, kw_only=True)
class GenerationJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # validated (router/protocol.py); put on the wire with each Generate call
    lora: LoRATarget | None = None  # None: the base model


def api_error_from_rpc(error: grpc.aio.AioRpcError, *, num_attempts: int = 1) -> tuple[ApiError, str]:
    """The HTTP error for a failed Generate call (the last of `num_attempts`), and the failure reason to count. A
    failed KV handoff (ABORTED) is counted by why it failed, as the decode worker named it
    (kv_transfer/handoff_failure.py), and says so."""
    code = error.code()
    status, reason = _RPC_ERRORS.get(code, (500, "worker_error"))
    details = error.details() or code.name
    if code == grpc.StatusCode.ABORTED:
        reason = handoff_failure.reason_in(error.trailing_metadata()) or handoff_failure.UNNAMED
        attempts = f" on the last of {num_attempts} attempts" if num_attempts > 1 else ""
        return ApiError(status_code=status, message=f"the KV handoff failed{attempts} ({reason}): {details}"), reason
    return ApiError(status_code=status, message=f"worker: {details}"), reason


def message_failure(message: serving_pb2.GenerateResponse) -> ApiError | None:
    """The error a message reports, if any: `error` set, or finish_reason "error" / "abort"."""
    if message.finish_reason == "abort":
        detail = f": {message.error}" if message.error else ""
        return ApiError(status_code=503, message=f"the worker aborted the request{detail}")
    if message.error or message.finish_reason == "error":
        return ApiError(status_code=500, message=f"the worker failed the request: {message.error or 'error'}")
    return None


class GenerationStream:
    """An open Generate call whose first message has arrived; see the module docstring for its lifecycle."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall,
        *,
        job: GenerationJob,
        route: Route,
        registry: WorkerRegistry,
        tracker: RequestTracker,
        abort_timeout_s: float,
        num_prior_tokens: int = 0,
    ) -> None:
        self.route = route
        self.job = job
        # A resumed request (router/migration.py): tokens streamed before the migration, now the end of the prompt.
        self.num_prior_tokens = num_prior_tokens
        self._call = call
        self._job = job
        self._registry = registry
        self._tracker = tracker
        self._abort_timeout_s = abort_timeout_s
        self._buffered: list[serving_pb2.GenerateResponse] = []
        self.num_generated_tokens = 0
        self._num_choices_left = job.params.num_sequences  # n > 1: the stream ends after every choice's finish
        self.usage: serving_pb2.Usage | None = None
        self.finished = False  # ended: with a finish_reason, an error, or end of stream
        self._closed = False
        self.ticket: Ticket | None = None  # the admission ticket, given back on close
        self.on_finished: list[Callable[[GenerationStream], None]] = []  # called once, on a successful finish
        self.first_timings: serving_pb2.StageTimings | None = None  # the first message's stage timings

    @property
    def worker_id(self) -> str:
        return self.route.target.worker_id

    async def read(self, *, count_rpc_failure: bool = True) -> serving_pb2.GenerateResponse | None:
        """The next message; None at the end of the stream. Raises grpc.aio.AioRpcError when the call fails
        (counted as a failed request unless `count_rpc_failure` is False: the caller may migrate it)."""
        if self._buffered:
            return self._buffered.pop(0)
        return await self._read_call(count_rpc_failure)

    async def read_first(self) -> None:
        """Wait for the first message (the Dispatcher's part). A failed call is not counted as a failed request
        here: the Dispatcher may retry it elsewhere."""
        message = await self._read_call(count_rpc_failure=False, first=True)
        if message is not None:
            self._buffered.append(message)
            if message.HasField("timings"):
                self.first_timings = message.timings

    def first_failure(self) -> ApiError | None:
        """After `read_first`: the error when the stream failed before producing anything."""
        if not self._buffered:
            return ApiError(status_code=500, message="the worker ended the stream without a finish reason")
        message = self._buffered[0]
        if message.finish_reason == "abort":
            detail = f": {message.error}" if message.error else ""
            return ApiError(status_code=503,
                            message=f"worker {self.worker_id} aborted the request before its first token{detail}")
        return message_failure(message)

    async def _read_call(self, count_rpc_failure: bool = True,
                         first: bool = False) -> serving_pb2.GenerateResponse | None:
        try:
            message = await self._read_or_channel_closed()
        except grpc.aio.AioRpcError as error:
            self.finished = True
            if count_rpc_failure:
                self._tracker.failed(api_error_from_rpc(error)[1])
            raise
        if message is grpc.aio.EOF:
            self.finished = True
            self._tracker.failed("worker_error")
            return None
        self._tracker.on_message(message)
        self.num_generated_tokens += len(message.token_ids)
        if message.finish_reason == "abort" and first:  # the client gets a 503 (first_failure): a failure
            self.finished = True
            self._tracker.failed("worker_aborted")
        elif message.finish_reason == "abort":
            self.finished = True  # counted as vLLM does: a finished request, reason abort
            self._tracker.finished("abort", num_prompt_tokens=self.num_prompt_tokens,
                                   num_generated_tokens=self.num_completion_tokens)
        elif message_failure(message) is not None:
            self.finished = True
            self._tracker.failed("worker_error")
        elif message.finish_reason and self._num_choices_left > 1:
            self._num_choices_left -= 1
        elif message.finish_reason:
            self.finished = True
            if message.HasField("usage"):
                self.usage = message.usage
            self._tracker.finished(message.finish_reason, num_prompt_tokens=self.num_prompt_tokens,
                                   num_generated_tokens=self.num_completion_tokens)
            for callback in self.on_finished:
                callback(self)
        return message

    async def _read_or_channel_closed(self) -> serving_pb2.GenerateResponse | object:
        """The call's next message. grpc.aio raises asyncio.CancelledError from a read whose call was cancelled
        locally: here, when the registry closed the channel of a worker that left the list (its grace spent). That
        is the worker going away, not this task being cancelled (the client gone, the server stopping): it is
        raised as the AioRpcError CANCELLED a worker that cancels the call itself gives (router/migration.py)."""
        try:
            return await self._call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=f"the channel to worker {self.worker_id} closed: it left the "
                                               "cluster's worker list") from None

    @property
    def num_prompt_tokens(self) -> int:
        """The client's prompt: without the tokens a resumed request carries as prompt."""
        if self.usage is not None and self.usage.prompt_tokens:
            return self.usage.prompt_tokens - self.num_prior_tokens
        return len(self._job.prompt_token_ids) - self.num_prior_tokens

    @property
    def num_completion_tokens(self) -> int:
        """Every token the client got, those streamed before a migration included."""
        if self.usage is not None and self.usage.completion_tokens:
            return self.num_prior_tokens + self.usage.completion_tokens
        return self.num_prior_tokens + self.num_generated_tokens

    @property
    def num_cached_tokens(self) -> int:
        return min(self.usage.cached_tokens, self.num_prompt_tokens) if self.usage is not None else 0

    def close(self) -> None:
        """Idempotent. Cancels the call and sends Abort unless the stream finished. Safe under cancellation:
        nothing here awaits."""
        if self._closed:
            return
        self._closed = True
        if self.ticket is not None:
            self.ticket.release()
        if self.finished:
            return
        self._tracker.finished("abort", num_prompt_tokens=self.num_prompt_tokens,
                               num_generated_tokens=self.num_completion_tokens)
        self._call.cancel()
        try:
            stub = self._registry.stub(self.worker_id)
        except KeyError:
            return  # the worker left; the cancellation is all we can do
        abort = stub.Abort(serving_pb2.AbortRequest(request_id=self._job.request_id), timeout=self._abort_timeout_s)
        self._registry.spawn(_quietly(abort, self._job.request_id), name=f"abort-{self._job.request_id}")


class Dispatcher:
    """Routes and opens Generate calls under `config.routing_policy`. `prefix_index`, when given (and the policy
    is prefix-aware), scores workers by the prefix they hold; `on_route(route)` counts each route taken."""

    def __init__(
        self, *, config: RouterConfig, registry: WorkerRegistry, admission: Admission,
        prefix_index: PrefixIndex | None = None, on_route: Callable[[Route], None] | None = None,
        on_peer_fetch: Callable[[PeerFetchPlan], None] | None = None,
    ) -> None:
        self._config = config
        self._registry = registry
        self._admission = admission
        # The index scores workers (prefix-aware) and names the holders peer fetch fetches from (any policy).
        self._routes_by_prefix = config.routing_policy == "prefix-aware"
        use_index = self._routes_by_prefix or config.kv_peer_fetch
        self._prefix_index = prefix_index if use_index else None
        self._on_route = on_route or (lambda route: None)
        self._peer_rates = PeerFetchRates()
        self._on_peer_fetch = on_peer_fetch or (lambda plan: None)
        self._turns = itertools.count()  # round-robin's turn; per gateway, as any round-robin balancer's
        # Prefills dispatched whose blocks the index does not list yet (router/inflight_prefixes.py): peer fetch's
        # holders before their KV events arrive.
        self._inflight = InflightPrefixes() if self._prefix_index is not None and config.kv_peer_fetch else None

    async def open(self, job: GenerationJob, tracker: RequestTracker) -> GenerationStream:
        """Admit `job`, dispatch it and wait for its first message. ApiError: 429 (queue full) or 503 (queued
        too long) with Retry-After, 503 when no worker can take it, or the worker's error mapped to HTTP. If
        cancelled meanwhile, it leaves the queue, or the call is cancelled and aborted."""
        num_blocks = num_blocks_needed(len(job.prompt_token_ids), self._config.block_size)
        try:
            ticket = await self._admission.acquire(num_blocks, job.params.priority)
        except AdmissionRefused as refused:
            tracker.failed(refused.reason)
            raise ApiError.from_refusal(refused) from None
        try:
            stream = await self._dispatch(job, tracker, num_blocks)
        except BaseException:
            ticket.release()
            raise
        stream.ticket = ticket
        return stream

    async def resume(
        self, job: GenerationJob, tracker: RequestTracker, *, num_prior_tokens: int, exclude: Sequence[str]
    ) -> GenerationStream:
        """Dispatch a migrated request (router/migration.py) as `open` does, but without admission (the request
        keeps its ticket) and never to a worker in `exclude`. Same errors as `open`."""
        num_blocks = num_blocks_needed(len(job.prompt_token_ids), self._config.block_size)
        return await self._dispatch(job, tracker, num_blocks, num_prior_tokens=num_prior_tokens, exclude=exclude)

    async def _dispatch(
        self, job: GenerationJob, tracker: RequestTracker, num_blocks: int, *, num_prior_tokens: int = 0,
        exclude: Sequence[str] = (),
    ) -> GenerationStream:
        """Route and open the call, retrying elsewhere as the module docstring says."""
        lookup = self._with_committed(await self._lookup(job))
        turn = next(self._turns)
        excluded: set[str] = set(exclude)
        if not num_prior_tokens:  # a resumed request does not wait for another's prefill
            lookup = await self._await_inflight(job, lookup, num_blocks, turn, excluded)
        last_error: grpc.aio.AioRpcError | None = None
        for attempt in range(1, self._config.max_dispatch_attempts + 1):
            loads = self._loads_for(job, excluded)
            pricer = self._fetch_pricer(lookup, loads, job)
            try:
                route = self._plan(job, loads, lookup, num_blocks, turn, pricer)
            except NoWorkerError as error:
                if last_error is not None:  # nowhere left to retry: the worker's own error says more
                    api_error, reason = api_error_from_rpc(last_error, num_attempts=attempt - 1)
                    tracker.failed(reason)
                    raise api_error from last_error
                tracker.failed("no_worker")
                raise ApiError(status_code=503, message=f"no worker can take the request: {error}") from error
            peer = self._price_peer_fetch(pricer, route, job)
            if lookup is not None and lookup.block_hashes and logger.isEnabledFor(logging.DEBUG):
                logger.debug("%s: prefix %s (%d blocks), held %s; prefill on %s (%d queued)", job.request_id,
                             lookup.block_hashes[0].hex()[:12], len(lookup.block_hashes), lookup.overlap,
                             route.prefill_worker.worker_id, route.prefill_worker.num_queued)
            stream = self._start(job, route, tracker, num_blocks, num_prior_tokens, peer)
            if self._prefix_index is not None and self._routes_by_prefix:
                self._prefix_index.record(lookup, route)
                if not num_prior_tokens:  # a resumed request's usage does not count its whole prompt
                    stream.on_finished.append(self._prediction_checker(_with_fetch(lookup, peer), route))
            stream.on_finished.append(self._rate_recorder(route, peer))
            inflight = self._note_inflight(job, lookup, route, peer)
            try:
                await stream.read_first()
            except grpc.aio.AioRpcError as error:
                self._settle(inflight, committed=False)
                code = error.code()
                retry = code in _RETRYABLE and attempt < self._config.max_dispatch_attempts
                if code == grpc.StatusCode.UNAVAILABLE:  # the target itself is unreachable
                    self._registry.mark_unhealthy(route.target.worker_id, f"Generate: {error.details()}")
                if retry:
                    blamed = _blamed_worker(code, route, loads)
                    logger.warning("%s failed on %s (%s: %s); retrying", job.request_id, route.target.worker_id,
                                   code.name, error.details())
                    if blamed is not None:
                        excluded.add(blamed)
                    tracker.retried(code.name.lower())
                    last_error = error
                    continue
                api_error, reason = api_error_from_rpc(error, num_attempts=attempt)
                tracker.failed(reason)
                raise api_error from error
            except BaseException:  # cancelled while waiting (client gone): tell the worker
                self._settle(inflight, committed=False)
                stream.close()
                raise
            failure = stream.first_failure()
            self._settle(inflight, committed=failure is None)
            if failure is not None:  # failed before any token: still time for a proper HTTP status
                raise failure
            self._on_route(route)
            return stream
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _loads_for(self, job: GenerationJob, excluded: set[str]) -> list[WorkerLoad]:
        """The workers `job` may go to: not `excluded`, and serving its LoRA adapter (name and digest) if it has one."""
        return [load for load in self._registry.loads() if load.worker_id not in excluded
                and (job.lora is None or (job.lora.name, job.lora.digest) in load.lora_adapters)]

    def _plan(self, job: GenerationJob, loads: Sequence[WorkerLoad], lookup: PrefixLookup | None, num_blocks: int,
              turn: int, pricer: Callable[[WorkerLoad], PeerFetchPlan | None] | None) -> Route:
        return plan_route(
            self._config.mode, loads, num_blocks=num_blocks, policy=self._config.routing_policy,
            prefix_overlap_blocks=lookup.overlap if lookup is not None else None,
            prefix_tier_blocks=lookup.lower_tier_blocks if lookup is not None else None, turn=turn,
            num_prompt_tokens=len(job.prompt_token_ids), block_size=self._config.block_size,
            local_prefill_threshold_tokens=self._config.disagg_prefill_threshold_tokens, fetch_price=pricer)

    async def _await_inflight(self, job: GenerationJob, lookup: PrefixLookup | None, num_blocks: int, turn: int,
                              excluded: set[str]) -> PrefixLookup | None:
        """Peer fetch on: when another worker is prefilling more of this prompt than any worker holds (a request of
        the same family dispatched moments ago; router/inflight_prefixes.py), and waiting for that prefill then
        fetching its blocks is expected to beat computing them where this request would go, wait for it (bounded
        by the recompute, never longer), then look the prompt up again. Otherwise `lookup` as it is."""
        if self._inflight is None or lookup is None or not lookup.block_hashes:
            return lookup
        loads = self._loads_for(job, excluded)
        try:
            fetcher = self._plan(job, loads, lookup, num_blocks, turn,
                                 self._fetch_pricer(lookup, loads, job)).prefill_worker
        except NoWorkerError:
            return lookup
        found = self._inflight.holder(lookup.block_hashes, exclude=fetcher.worker_id, committed=False)
        holder = next((load for load in loads if found is not None and load.worker_id == found.entry.worker_id
                       and load.incarnation == found.entry.incarnation), None)
        if found is None or holder is None:
            return lookup
        # What the fetcher gets without waiting: its own blocks, or a fetch from a holder other than the one still
        # prefilling and the decode worker it hands off to (prefix-aware's provisional index entries list both as
        # holding blocks that neither can send yet).
        pending = {holder.worker_id, *found.entry.receivers}
        others = self._fetch_pricer(lookup, [load for load in loads if load.worker_id not in pending], job)
        now = others(fetcher) if others is not None else None
        have = max(lookup.overlap.get(fetcher.worker_id, 0), now.num_blocks if now is not None and now.fetch else 0,
                   min(found.entry.num_held, found.num_blocks))
        plan = price_peer_fetch({fetcher.worker_id: have, holder.worker_id: found.num_blocks}, fetcher, [holder],
                                num_prompt_tokens=len(job.prompt_token_ids), block_size=self._config.block_size,
                                rates=self._peer_rates)
        wait_s = found.entry.expected_commit_s - self._inflight.now()
        timeout_s = wait_for_inflight(plan, wait_s=wait_s)
        if timeout_s is None:
            return lookup
        logger.debug("%s: blocks %d to %d of its prompt are being prefilled on %s (%s), expected in %.0f ms: "
                     "waiting at most %.0f ms to fetch them", job.request_id, have, found.num_blocks - 1,
                     holder.worker_id, found.entry.request_id, wait_s * 1e3, timeout_s * 1e3)
        committed = await self._inflight.settled(found.entry, timeout_s)
        logger.debug("%s: %s's prefill %s", job.request_id, found.entry.request_id,
                     "ended" if committed else "is not done (or failed): computing")
        return self._with_committed(await self._lookup(job))

    def _with_committed(self, lookup: PrefixLookup | None) -> PrefixLookup | None:
        """`lookup` with the prefills that ended moments ago and that the index may not list yet: their worker
        holds their blocks on its device. An entry the index already confirms is dropped."""
        if self._inflight is None or lookup is None or not lookup.block_hashes:
            return lookup
        live = {load.worker_id: load.incarnation for load in self._registry.loads()}
        overlap, held = dict(lookup.overlap), dict(lookup.held)
        for found in self._inflight.matches(lookup.block_hashes, committed=True):
            wid = found.entry.worker_id
            if live.get(wid) != found.entry.incarnation:
                continue
            if lookup.overlap.get(wid, 0) >= found.num_blocks:
                self._inflight.confirmed(found.entry)
            elif overlap.get(wid, 0) < found.num_blocks:
                overlap[wid] = found.num_blocks
                held.pop(wid, None)  # all on its device: it has just computed (or loaded) them there
        if overlap == lookup.overlap:
            return lookup
        return dataclasses.replace(lookup, overlap=overlap, held=held)

    def _note_inflight(self, job: GenerationJob, lookup: PrefixLookup | None, route: Route,
                       peer: PeerFetchPlan | None) -> InflightEntry | None:
        """Record the prefill just dispatched, with when it is expected to end: the tokens it computes at its
        worker's measured prefill rate, once for it and once for each request queued there before it."""
        if self._inflight is None or lookup is None or not lookup.block_hashes:
            return None
        worker = route.prefill_worker
        num_held = max(lookup.overlap.get(worker.worker_id, 0), peer.num_blocks if peer is not None and peer.fetch
                       else 0)
        computed = max(len(job.prompt_token_ids) - num_held * self._config.block_size, 1)
        expected_s = computed / self._peer_rates.prefill_tokens_s(worker.worker_id) * (1 + worker.num_queued)
        receivers = (route.target.worker_id,) if route.target.worker_id != worker.worker_id else ()
        return self._inflight.add(job.request_id, worker.worker_id, worker.incarnation, lookup.block_hashes,
                                  expected_s=expected_s, num_held=num_held, receivers=receivers)

    def _settle(self, entry: InflightEntry | None, *, committed: bool) -> None:
        if entry is None or self._inflight is None:
            return
        if committed:
            self._inflight.commit(entry)
        else:
            self._inflight.drop(entry)

    def _start(
        self, job: GenerationJob, route: Route, tracker: RequestTracker, num_blocks: int, num_prior_tokens: int,
        peer: PeerFetchPlan | None = None,
    ) -> GenerationStream:
        request = serving_pb2.GenerateRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            params=sampling_params_to_proto(job.params),
            prefill_endpoint=route.prefill.endpoint if route.prefill is not None else "",
            router_queue_s=tracker.dispatched(),
            lora_name=job.lora.name if job.lora is not None else "",
            lora_digest=job.lora.digest if job.lora is not None else "",
        )
        if peer is not None and peer.fetch:
            request.peer_fetch.CopyFrom(serving_pb2.PeerFetch(
                endpoint=peer.holder.endpoint, worker_id=peer.holder.worker_id, num_blocks=peer.num_blocks))
        self._registry.note_dispatch(route.target.worker_id, num_blocks)
        if route.prefill is not None:
            self._registry.note_dispatch(route.prefill.worker_id, num_blocks)
        call = self._registry.stub(route.target.worker_id).Generate(request, timeout=self._config.request_timeout_s)
        return GenerationStream(call, job=job, route=route, registry=self._registry, tracker=tracker,
                                abort_timeout_s=self._config.abort_timeout_s, num_prior_tokens=num_prior_tokens)

    @property
    def max_migrations(self) -> int:
        return self._config.max_migrations

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        self._registry.mark_unhealthy(worker_id, reason)

    def _fetch_pricer(self, lookup: PrefixLookup | None, loads: Sequence[WorkerLoad],
                      job: GenerationJob) -> Callable[[WorkerLoad], PeerFetchPlan | None] | None:
        """Prices a peer fetch for a worker that might run the prompt (router/peer_fetch.py); None when peer fetch
        is off or there is no index. Routing (prefix-aware) prices its candidates with it, then the chosen one's
        fetch is decided with it: one cost model."""
        if lookup is None or not self._config.kv_peer_fetch:
            return None
        return fetch_pricer(lookup.overlap, loads, num_prompt_tokens=len(job.prompt_token_ids),
                            block_size=self._config.block_size, rates=self._peer_rates,
                            device_reach=lookup.device_reach)

    def _price_peer_fetch(self, pricer: Callable[[WorkerLoad], PeerFetchPlan | None] | None, route: Route,
                          job: GenerationJob) -> PeerFetchPlan | None:
        """Fetch or compute the prompt's head that another worker holds; None when peer fetch is off, there is no
        index, or no other worker holds more of the prompt. Both prices go to a debug line and the metrics."""
        if pricer is None:
            return None
        fetcher = route.prefill_worker
        plan = pricer(fetcher)
        if plan is None:
            return None
        logger.debug("%s: blocks %d to %d of its prompt are on %s: fetch %.1f ms, recompute %.1f ms on %s: %s",
                     job.request_id, plan.first_block, plan.num_blocks - 1, plan.holder.worker_id,
                     plan.fetch_s * 1e3, plan.recompute_s * 1e3, fetcher.worker_id,
                     "fetch" if plan.fetch else "recompute")
        self._on_peer_fetch(plan)
        return plan

    def _rate_recorder(self, route: Route, peer: PeerFetchPlan | None) -> Callable[[GenerationStream], None]:
        """After a request: the prefill rate of the worker that ran its prompt, and its peer fetch's link rate."""
        def record(stream: GenerationStream) -> None:
            timings = stream.first_timings
            if timings is None:
                return
            fetcher_id = route.prefill_worker.worker_id
            computed = stream.num_prompt_tokens - stream.num_cached_tokens
            logger.debug("%s: %s computed %d of its %d prompt tokens in %.3f s", stream.job.request_id, fetcher_id,
                         computed, stream.num_prompt_tokens, timings.prefill_s)
            if stream.usage is not None and not stream.num_prior_tokens:
                self._peer_rates.observe_prefill(fetcher_id, computed, timings.prefill_s)
            if peer is not None and peer.fetch:
                self._peer_rates.observe_fetch(peer.holder.worker_id, fetcher_id, timings.peer_fetch_bytes,
                                               timings.peer_fetch_s)
        return record

    async def _lookup(self, job: GenerationJob) -> PrefixLookup | None:
        if self._prefix_index is None:
            return None
        try:
            return await self._prefix_index.lookup(job.prompt_token_ids,
                                                   adapter=job.lora.digest if job.lora is not None else None)
        except Exception:  # the index is an optimisation; route by load without it
            logger.exception("prefix index lookup failed; routing by load only")
            return None

    def _prediction_checker(self, lookup: PrefixLookup | None, route: Route) -> Callable[[GenerationStream], None]:
        def check(stream: GenerationStream) -> None:
            assert self._prefix_index is not None
            if stream.usage is not None:
                self._prefix_index.check_prediction(lookup, route, stream.num_prompt_tokens,
                                                    stream.num_cached_tokens)

        return check


async def _quietly(abort: Awaitable[serving_pb2.AbortResponse], request_id: str) -> None:
    try:
        await abort
    except grpc.aio.AioRpcError as error:
        logger.debug("Abort(%s) failed: %s", request_id, error.code().name)


def _with_fetch(lookup: PrefixLookup | None, peer: PeerFetchPlan | None) -> PrefixLookup | None:
    """The lookup as the prefill worker's prefix hit will show it: with the blocks a peer fetch brings it."""
    if lookup is None or peer is None or not peer.fetch:
        return lookup
    return dataclasses.replace(lookup, overlap={**lookup.overlap, peer.fetcher_id: peer.num_blocks})
