"""The router's HTTP app: OpenAI's completions, chat completions and responses, models, health and metrics.

    POST /v1/completions, /v1/chat/completions   validate -> tokenize -> route -> worker Generate -> JSON | SSE
    POST /v1/responses                           OpenAI's Responses API, stateless: a chat completion underneath
                                                 (router/responses_api.py)
    GET  /v1/models, /v1/models/{name}           the served model names, in OpenAI's list shape; one of them
    GET  /health                                 200 when each role the mode needs has a healthy worker, else 503
    GET  /live                                   200 while this process's event loop answers (liveness, not readiness)
    GET  /metrics                                Prometheus text; refreshes worker loads first (the pools'
                                                 autoscaling signals among it: router/pool_signals.py)
    POST /admin/scale, GET /admin/pools          the admin API (router/admin.py), only with an admin token
    GET  /v1/prefix_index                        the Redis prefix index: its state, blocks indexed per worker
                                                 and per tier (device, disk, host)

With API keys (router/api_keys.py), /v1/* (and /metrics with --metrics-require-key) need a bearer key; /health
stays open. While the admission queue is full, a generation request gets its 429 before its body is read
(router/admission_guard.py).

`create_app` owns the registry's and the prefix index client's lifecycles: the app's lifespan starts them
(inside the serving event loop, where their gRPC channels and Redis connections must live) and closes them.

Cancellation: a client that disconnects while the router waits on a worker — a non-streaming request, or a
streaming one before its first token — cancels the wait; during a stream, Starlette cancels the body iterator.
Either way the stream is closed, which cancels the gRPC call and sends Abort (to the worker that holds the
request now, after a migration: router/resumable_stream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from router import package_version
from router.admin import AdminApi, install_admin_routes
from router.admission import Admission
from router.admission_guard import AdmissionGuard
from router.api_keys import KEY_ID_STATE, AccessControl, ApiKeyGuard
from router.autoscaler import Autoscaler, ScalableCluster
from router.batched_completions import StreamGroup, batch_prompts, gather_or_cancel, merge_bodies, merged_events
from router.body_limit import BodyLimit
from router.cache_api import install_cache_routes
from router.config import RouterConfig
from router.dispatcher import Dispatcher, GenerationJob
from router.errors import (
    GENERATION_ERRORS,
    ApiError,
    bad_request,
    error_body,
    install_error_handlers,
    without_validation_errors,
)
from router.lora_api import ServedModels, install_lora_routes
from router.metrics import PrefixIndexCollector, RequestTracker, RestartCounts, RouterMetrics
from router.pool_signals import PoolSignalCollector, PoolSignals, pool_signals
from router.prefix_routing import PrefixIndex
from router.prompt import chat_prompt_token_ids, completion_prompt_token_ids, fit_max_tokens, truncate_prompt
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_chat_request,
    check_completion_request,
    num_logprobs,
    to_sampling_params,
)
from router.request_chat_template import RequestChatTemplates
from router.request_ids import HEADER as REQUEST_ID_HEADER
from router.request_ids import RequestIdHeaders, response_id
from router.request_log import RequestLog
from router.responses import ResponseHeader
from router.responses_api import (
    RESPONSES_PARAMS,
    ResponseShape,
    ResponsesRequest,
    check_responses_request,
    to_chat_request,
)
from router.resumable_stream import ResumableStream
from router.routing import LoRATarget
from router.streaming import OutputSpec, collect_response, sse_events, stream_bodies
from router.structured import structured_outputs_of
from router.tokenize_api import install_tokenize_routes
from router.tools import plan_tools
from router.worker_registry import WorkerRegistry

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer
    from router.structured import GrammarSpec
    from router.tools import ToolPlan

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


def create_app(
    config: RouterConfig,
    registry: WorkerRegistry,
    tokenizer: Tokenizer,
    *,
    prefix_index: PrefixIndex | None = None,
    restart_counts: RestartCounts | None = None,
    admin: AdminApi | None = None,
    access: AccessControl | None = None,
    pool_controller: ScalableCluster | None = None,
) -> FastAPI:
    """The FastAPI app serving `config.served_model_names` through the workers `registry` knows.

    `prefix_index` (optional): the Redis prefix index; without it (or with Redis down) workers are chosen by load.
    `restart_counts` (optional): the cluster controller's worker restarts, for /metrics.
    `admin` (optional): the admin API's token and controller (router/admin.py); without it /admin/* is a 404.
    `access` (optional): API keys and per-key rate limits (router/api_keys.py); without it /v1/* is open.
    `config.autoscaler` (disaggregated only): run the built-in autoscaler (router/autoscaler.py) in the app's
    lifespan, resizing the pools through `pool_controller`.
    """
    autoscaler = config.autoscaler
    if autoscaler is not None and (pool_controller is None or config.mode != "disaggregated"):
        raise ValueError("the autoscaler needs a pool controller and the disaggregated mode")
    templates = RequestChatTemplates(tokenizer, trusted=config.trust_request_chat_template)
    request_log = RequestLog(tokenizer, config.max_log_len) if config.enable_log_requests else None
    metrics = RouterMetrics(registry.snapshots, roles=config.roles_needed, restart_counts=restart_counts,
                            signal_window_s=config.signal_window_s)
    if prefix_index is not None:
        metrics.registry.register(PrefixIndexCollector(prefix_index.client))
    admission = Admission(config, role=config.target_role,
                          on_refused=lambda reason: metrics.admission_rejections.labels(reason=reason).inc(),
                          on_admitted=metrics.admission_queue_time.observe,
                          by_priority=config.scheduling_policy == "priority")
    metrics.admission_queue_requests.set_function(lambda: admission.num_queued)
    metrics.admission_in_flight_requests.set_function(lambda: admission.in_flight.num_requests)
    registry.add_listener(lambda: admission.update(registry.loads()))

    def signals() -> dict[str, PoolSignals]:
        now_s = time.monotonic()
        return pool_signals(registry.snapshots(), config.roles_needed, ttft_s=metrics.ttft_window.quantiles(now_s),
                            tpot_s=metrics.tpot_window.quantiles(now_s), num_gateway_queued=admission.num_queued,
                            target_role=config.target_role)

    metrics.registry.register(PoolSignalCollector(signals))
    scaler = None
    if autoscaler is not None and pool_controller is not None:
        for pool in config.roles_needed:
            for direction in ("up", "down"):
                metrics.autoscaler_decisions.labels(pool=pool, direction=direction)
        scaler = Autoscaler(autoscaler, pool_controller, signals, refresh=registry.refresh,
                            on_resize=lambda pool, direction: metrics.autoscaler_decisions.labels(
                                pool=pool, direction=direction).inc())
    dispatcher = Dispatcher(config=config, registry=registry, admission=admission, prefix_index=prefix_index,
                            on_route=metrics.count_route, on_peer_fetch=metrics.count_peer_fetch)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        if prefix_index is not None:
            await prefix_index.client.start()
        scaling = asyncio.create_task(scaler.run(), name="autoscaler") if scaler is not None else None
        try:
            yield
        finally:
            if scaling is not None:
                scaling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scaling
            if prefix_index is not None:
                await prefix_index.close()
            await registry.close()

    # /openapi.json: the request models' schema, for schema-driven clients and fuzzers; no HTML docs pages.
    app = FastAPI(title="splitserve router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    if config.root_path:  # as vLLM sets it: paths are served with the prefix and without (a proxy that strips it)
        app.root_path = config.root_path
    app.add_middleware(BodyLimit, max_body_bytes=config.max_request_body_bytes)  # 413 before any parsing
    if config.admission_control:  # a full queue's 429 before the body is read (outside BodyLimit, which reads
        # it), after the API key's check
        app.add_middleware(AdmissionGuard, admission=admission,
                           on_refused=lambda reason: metrics.request_failure.labels(reason=reason).inc())
    if access is not None:  # outside those, so a request without a key is refused before its body is read
        app.add_middleware(ApiKeyGuard, access=access,
                           on_rejected=lambda reason: metrics.api_key_rejections.labels(reason=reason).inc(),
                           on_admitted=lambda kid: metrics.api_key_requests.labels(key_id=kid).inc())
    if config.allowed_origins:  # outermost: a browser's preflight carries no key, and a 401 or 429 its headers
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
    if config.enable_request_id_headers:  # outermost: a 401, 413 or 429 carries it too
        app.add_middleware(RequestIdHeaders)
    install_error_handlers(app)
    app.state.metrics = metrics
    app.state.registry = registry
    if admin is not None:
        install_admin_routes(app, admin, registry, config.roles_needed)

    models = ServedModels(config.served_model_names, registry)  # the base model's names and the LoRA adapters'

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        arrival_s = time.perf_counter()
        lora = models.resolve(body.model)
        check_completion_request(body)
        prompts = batch_prompts(body)
        bodies = [body] if prompts is None else [body.model_copy(update={"prompt": p}) for p in prompts]
        prepared = [await _prepare(raw, one, lambda one=one: completion_prompt_token_ids(one, tokenizer), lora,
                                   structured_outputs=structured_outputs_of(one), tools=None,
                                   max_tokens=one.max_tokens, default_max_tokens=config.default_completion_max_tokens,
                                   max_tokens_param="max_tokens")
                    for one in bodies]  # every prompt checked before any is dispatched
        if prompts is None:
            return await _generate(raw, *prepared[0], body.stream, _tracker(raw, arrival_s))
        return await _generate_batch(raw, prepared, body.stream, arrival_s)

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_s = time.perf_counter()
        return await _chat(raw, body, arrival_s, models.resolve(body.model),
                           max_tokens_param="max_completion_tokens" if body.max_completion_tokens is not None
                           else "max_tokens")

    @app.post("/v1/responses", responses=GENERATION_ERRORS)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        arrival_s = time.perf_counter()
        lora = models.resolve(body.model)
        check_responses_request(body)
        chat = to_chat_request(body)
        try:
            return await _chat(raw, chat, arrival_s, lora, max_tokens_param="max_output_tokens",
                               shape=ResponseShape(body, chat))
        except ApiError as error:  # the chat request's fields by their Responses names
            error.param = RESPONSES_PARAMS.get(error.param, error.param)  # type: ignore[arg-type]
            raise

    async def _chat(raw: Request, body: ChatCompletionRequest, arrival_s: float, lora: LoRATarget | None, *,
                    max_tokens_param: str, shape: ResponseShape | None = None) -> Response:
        check_chat_request(body)
        tools = plan_tools(body)
        structured_outputs = structured_outputs_of(body)
        if tools is not None and tools.mode != "auto":
            if structured_outputs is not None:
                raise bad_request(f"tool_choice {body.tool_choice!r} constrains the output: it cannot be combined "
                                  "with response_format or guided decoding", "tool_choice")
            structured_outputs = tools.structured_outputs()
        job, spec = await _prepare(raw, body, lambda: chat_prompt_token_ids(body, templates.tokenizer_for(body), tools),
                                   lora, structured_outputs=structured_outputs, tools=tools,
                                   max_tokens=body.requested_max_tokens, default_max_tokens=None,
                                   max_tokens_param=max_tokens_param)
        return await _generate(raw, job, spec, body.stream, _tracker(raw, arrival_s), shape)

    async def _prepare(
        raw: Request, body: CompletionRequest | ChatCompletionRequest, prompt_token_ids: Callable[[], list[int]],
        lora: LoRATarget | None, *, structured_outputs: GrammarSpec | None, tools: ToolPlan | None,
        max_tokens: int | None, default_max_tokens: int | None, max_tokens_param: str,
    ) -> tuple[GenerationJob, OutputSpec]:
        """What every endpoint does with a checked request: tokenize its prompt (in a thread: it may be long), fit
        `max_tokens` (else `default_max_tokens`, else all that fits) to the context; the job for the workers and
        how its answer is written."""
        chat = isinstance(body, ChatCompletionRequest)
        prefix = "chatcmpl" if chat else "cmpl"
        workers_id = f"{prefix}-{uuid.uuid4().hex}"
        public_id = response_id(prefix, raw.headers.get(REQUEST_ID_HEADER), body.request_id, workers_id=workers_id)
        whole = await asyncio.to_thread(prompt_token_ids)
        token_ids = truncate_prompt(whole, body.truncate_prompt_tokens, config.max_model_len)
        fitted = fit_max_tokens(max_tokens, default=default_max_tokens, num_prompt_tokens=len(token_ids),
                                max_model_len=config.max_model_len, prompt_param="messages" if chat else "prompt",
                                max_tokens_param=max_tokens_param)
        generation = config.generation_defaults  # the model's generation_config.json: its cap, its sampling
        if generation.max_new_tokens is not None:
            fitted = min(fitted, generation.max_new_tokens)
        params = to_sampling_params(body, max_tokens=fitted, structured_outputs=structured_outputs,
                                    defaults=generation.sampling, scheduling_policy=config.scheduling_policy,
                                    max_logprobs=config.max_logprobs)
        job = GenerationJob(request_id=workers_id, prompt_token_ids=token_ids, params=params, lora=lora)
        truncated = len(token_ids) < len(whole)
        as_ids = body.return_tokens_as_token_ids
        spec = dataclasses.replace(_output_spec(body, job, tokenizer, chat=chat, truncated=truncated,
                                                response_id=public_id), tools=tools,
                                   tokens_as_ids=config.return_tokens_as_token_ids if as_ids is None else as_ids,
                                   return_token_ids=body.return_token_ids)
        if request_log is not None:
            request_log.received(public_id, job)
        return job, spec

    def _tracker(raw: Request, arrival_s: float) -> RequestTracker:
        tracker = metrics.tracker(arrival_s)
        limiter = access.limiter if access is not None else None
        kid = getattr(raw.state, KEY_ID_STATE, None)
        if limiter is not None and kid is not None:  # the key pays for its tokens once they are known
            tracker.on_finished = lambda num_tokens: limiter.charge_tokens(kid, num_tokens)
        return tracker

    async def _open(job: GenerationJob, tracker: RequestTracker) -> ResumableStream:
        return ResumableStream(await dispatcher.open(job, tracker), dispatcher=dispatcher, tracker=tracker,
                               tokenizer=tokenizer)

    async def _generate(
        raw: Request, job: GenerationJob, spec: OutputSpec, stream: bool, tracker: RequestTracker,
        shape: ResponseShape | None = None,
    ) -> Response:
        """Run `job` and answer as a (chat) completion, or as the Responses API's `shape` of one."""
        async def open_stream() -> ResumableStream:
            return await _open(job, tracker)

        if not stream:

            async def collect() -> dict[str, object]:
                body = await collect_response(await open_stream(), spec)
                return body if shape is None else shape.body(body)

            result = await _unless_disconnected(raw, collect())
            if result is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return JSONResponse(result)
        opened = await _unless_disconnected(raw, open_stream(), on_orphan=ResumableStream.close)
        if opened is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        events = sse_events(opened, spec) if shape is None else shape.events(stream_bodies(opened, spec))
        return _StreamResponse(opened, events)

    async def _generate_batch(
        raw: Request, prepared: list[tuple[GenerationJob, OutputSpec]], stream: bool, arrival_s: float,
    ) -> Response:
        """Run a batch's jobs, each a request of its own, and answer as one completion (router/batched_completions.py).
        """
        opened: list[ResumableStream] = []

        async def open_one(job: GenerationJob) -> ResumableStream:
            one = await _open(job, _tracker(raw, arrival_s))
            opened.append(one)
            return one

        async def open_all() -> list[ResumableStream]:
            try:
                return await gather_or_cancel(*(open_one(job) for job, _ in prepared))
            except BaseException:  # one failed, or the client left: none stays open
                StreamGroup(opened).close()
                raise

        n = prepared[0][1].n
        if not stream:

            async def collect() -> dict[str, object]:
                streams = await open_all()
                bodies = await gather_or_cancel(*(collect_response(s, spec)
                                                  for s, (_, spec) in zip(streams, prepared, strict=True)))
                return merge_bodies(bodies, n)

            try:
                result = await _unless_disconnected(raw, collect())
            finally:
                StreamGroup(opened).close()  # idempotent: each collect closed its own, unless it never ran
            if result is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return JSONResponse(result)
        streams = await _unless_disconnected(raw, open_all(), on_orphan=lambda s: StreamGroup(s).close())
        if streams is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        events = merged_events([stream_bodies(s, spec) for s, (_, spec) in zip(streams, prepared, strict=True)], n,
                               response_id=prepared[0][1].header.request_id)
        return _StreamResponse(StreamGroup(streams), events)  # type: ignore[arg-type]

    app.openapi = without_validation_errors(app)  # type: ignore[method-assign]

    install_tokenize_routes(app, config, templates, models)
    install_cache_routes(app, registry)
    install_lora_routes(app, models, registry)
    card = {"object": "model", "created": created, "owned_by": "splitserve", "parent": None,
            "max_model_len": config.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, object]:
        return {"object": "list", "data": models.cards(card)}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (client.models.retrieve); a name may hold slashes
    async def model(model: str) -> dict[str, object]:
        return models.card(model, card)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = registry.healthy_roles()
        missing = [role for role in config.roles_needed if role not in healthy]
        if missing:
            message = f"no healthy {' or '.join(missing)} worker"
            return JSONResponse(error_body(503, message), status_code=503)
        workers = [{"worker_id": s.info.worker_id, "role": s.info.role, "healthy": s.healthy}
                   for s in registry.snapshots()]
        return JSONResponse({"status": "ok", "mode": config.mode, "workers": workers})

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        """As vLLM's: the server's version, open like /health."""
        return {"version": package_version()}

    @app.get("/live")
    async def live() -> JSONResponse:
        """Liveness apart from readiness: the gateway answers whatever its workers do (a cluster without a healthy
        worker is not ready, /health says so, but restarting the gateway would not help it)."""
        return JSONResponse({"status": "live"})

    @app.get("/v1/prefix_index")
    async def prefix_index_stats() -> JSONResponse:
        """The prefix index as operators see it: up or down, and blocks indexed per worker and incarnation, in all
        (`num_blocks`: held, on any tier) and per tier (`num_blocks_by_tier`: "device", "disk", "host")."""
        namespace = registry.hash_namespace()
        body: dict[str, object] = {"enabled": prefix_index is not None, "routing_policy": config.routing_policy,
                                   "up": bool(prefix_index is not None and prefix_index.client.up),
                                   "namespace": None, "workers": []}
        if prefix_index is None or namespace is None:
            return JSONResponse(body)
        body["namespace"] = {"model": namespace.model, "block_size": namespace.block_size,
                             "kv_dtype": namespace.kv_dtype}
        try:
            stats = await prefix_index.client.worker_stats(namespace)
        except Exception as exc:  # noqa: BLE001 - Redis down: say so, with what is known
            body["up"] = False
            body["error"] = f"{type(exc).__name__}: {exc}"
            return JSONResponse(body, status_code=503)
        live = registry.incarnations()
        body["workers"] = [{"worker_id": s.worker_id, "incarnation": s.incarnation, "role": s.role,
                            "num_blocks": s.num_blocks, "num_blocks_by_tier": s.num_blocks_by_tier,
                            "batches_applied": s.seq,
                            "live": live.get(s.worker_id) == s.incarnation} for s in stats]
        return JSONResponse(body)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        await registry.poll_loads()  # so a scrape right after a workload shows the current block counts
        if prefix_index is not None:  # the index's blocks per worker and tier (PrefixIndexCollector)
            await prefix_index.client.refresh_stats(registry.hash_namespace())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _output_spec(
    body: CompletionRequest | ChatCompletionRequest, job: GenerationJob, tokenizer: Tokenizer, *, chat: bool,
    response_id: str, truncated: bool = False,
) -> OutputSpec:
    """`response_id`: the answer's `id` (router/request_ids.py), not the job's (the workers')."""
    return OutputSpec(
        header=ResponseHeader(request_id=response_id, created=int(time.time()), model=body.model, chat=chat),
        tokenizer=tokenizer,
        num_logprobs=num_logprobs(body),
        include_usage=body.include_usage,
        continuous_usage=body.include_usage and body.stream_options.continuous_usage_stats,
        n=body.n,
        num_choices=job.params.num_sequences,
        echo=_echo_text(body, job, tokenizer, truncated),
        prompt_token_ids=tuple(job.prompt_token_ids),
        prompt_logprobs=body.prompt_logprobs is not None,
    )


def _echo_text(body: CompletionRequest | ChatCompletionRequest, job: GenerationJob, tokenizer: Tokenizer,
               truncated: bool = False) -> str | None:
    """Completions' echo: the prompt as the client sent it (a text), or its token ids decoded, as vLLM does; cut by
    `truncate_prompt_tokens`, the tokens kept, decoded (what the model saw, and what echo's logprobs are of).
    Chat's (vLLM's): the last message's text when it is the assistant's, else nothing."""
    if isinstance(body, ChatCompletionRequest):
        last = body.messages[-1]
        if not body.echo or last.role != "assistant":
            return None
        if isinstance(last.content, list):  # text parts, joined as the prompt joins them
            return "\n".join(part.text or "" for part in last.content)
        return last.content or None
    if not body.echo:
        return None
    if truncated:
        return tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False)
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt and isinstance(
        body.prompt[0], str | list) else body.prompt
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False)


async def _unless_disconnected(
    request: Request, work: Awaitable[T], *, on_orphan: Callable[[T], object] | None = None
) -> T | None:
    """`await work`, unless the client disconnects first: then cancel it and return None.

    The request body has been read by now, so the next ASGI message can only be http.disconnect.
    `on_orphan` gets a result that arrived in the same instant as the disconnect (no one will use it).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself was cancelled (server shutting down)
        task.cancel()
        watcher.cancel()
        raise
    if not watcher.done():
        watcher.cancel()
        return task.result()  # raises the work's ApiError, if any
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, Exception):  # the client is gone; nobody to tell
        return None
    if on_orphan is not None:
        on_orphan(result)
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _StreamResponse(StreamingResponse):
    """SSE over an open ResumableStream, closing the stream however the response ends — including when the
    client is gone before the body iterator ever starts (then the generator's own `finally` never runs)."""

    def __init__(self, stream: ResumableStream, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()
