"""LoRA adapters at the gateway, as vLLM serves them (--enable-lora on the workers):

- a request's `model` is the base model's name (--served-model-name) or an adapter's, as the workers report their
  adapters in each GetLoad; another name is a 404 listing both. A request under an adapter is dispatched only to
  workers serving it (name and digest), and its prompt's blocks are looked up from the adapter's hash root.
- `GET /v1/models` lists the adapters after the base model, each with `parent` the base model's name and `root`
  the adapter's path, as vLLM lists them.
- With VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in the gateway's environment (vLLM's switch), adapters load and unload
  at run time on every worker, all or none:

    POST /v1/load_lora_adapter   {"lora_name": ..., "lora_path": ...}
        → 200 "Success: LoRA adapter '<name>' added successfully."
        → 400 the adapter cannot load on some worker, or the name is taken (the base model's, or an adapter's);
          502 a worker failed otherwise (unreachable, timed out); either way every worker that may have loaded it
          unloads it again
    POST /v1/unload_lora_adapter {"lora_name": ...}
        → 200 "Success: LoRA adapter '<name>' removed successfully."; 404 no worker serves it

  A worker that restarts or joins later (scaling) starts with the --lora-modules adapters only: the gateway gives it
  the adapters it loaded at run time again once a load poll shows the lack (`RuntimeAdapters`; one try per worker
  and adapter every RELOAD_BACKOFF_S), and meanwhile routes each adapter's requests to the workers that serve it.
  Another gateway replica knows only its own loads. Keyed like /v1/* when API keys are set. Loads, unloads and
  reloads run one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from protos import serving_pb2, serving_pb2_grpc
from router.routing import LoRATarget
from router.errors import ApiError, bad_request
from router.protocol import check_json_text
from router.worker_registry import WorkerRegistry

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_CALL_TIMEOUT_S = 120.0  # reading an adapter's files and moving it to the device
_REFUSED = ("INVALID_ARGUMENT", "ALREADY_EXISTS")  # the worker refused the adapter: it loaded nothing
RELOAD_BACKOFF_S = 30.0


class ServedModels:
    """The names a request's `model` may carry: the base model's and the adapters' the workers serve now."""

    def __init__(self, served_model_names: tuple[str, ...], registry: WorkerRegistry) -> None:
        self.base = served_model_names
        self._registry = registry
        self._shadowed: set[str] = set()  # adapters named like the base model, warned about once

    def resolve(self, model: str) -> LoRATarget | None:
        """None for the base model, the adapter `model` names, or a 404 (as vLLM and OpenAI answer it)."""
        if model in self.base:
            return None
        adapter = self._registry.lora_adapters().get(model)
        if adapter is None:
            names = [*self.base, *sorted(self._registry.lora_adapters())]
            raise ApiError(status_code=404, param="model",
                           message=f"the model {model!r} does not exist; this server serves {', '.join(names)}")
        return LoRATarget(adapter.name, adapter.digest)

    def cards(self, card: dict[str, object]) -> list[dict[str, object]]:
        """/v1/models' entries: the base model's names, then each adapter (`card`: the base model's entry)."""
        adapters = self._registry.lora_adapters()
        for name in set(adapters) & set(self.base) - self._shadowed:
            logger.warning("a LoRA adapter is named %r, as the base model is: requests naming it get the base model",
                           name)
            self._shadowed.add(name)
        return [{**card, "id": name, "root": name} for name in self.base] + [
            {**card, "id": name, "root": adapters[name].path or name, "parent": self.base[0]}
            for name in sorted(adapters) if name not in self.base]

    def card(self, model: str, card: dict[str, object]) -> dict[str, object]:
        self.resolve(model)
        return next(c for c in self.cards(card) if c["id"] == model)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's carries an optional lora_int_id too

    lora_name: str


def runtime_lora_updating() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


def install_lora_routes(app: FastAPI, models: ServedModels, registry: WorkerRegistry) -> None:
    """The run-time load and unload routes, when the environment allows them (else they do not exist: 404)."""
    if not runtime_lora_updating():
        return
    one_at_a_time = asyncio.Lock()  # two loads of one name must not undo each other's
    loaded = RuntimeAdapters(registry, one_at_a_time)
    registry.add_listener(loaded.reconcile)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        check_json_text(body.lora_name, "lora_name")
        check_json_text(body.lora_path, "lora_path")
        async with one_at_a_time:
            answer = await _load_everywhere(models, registry, body)
            loaded.paths[body.lora_name] = body.lora_path
            return answer

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        check_json_text(body.lora_name, "lora_name")
        async with one_at_a_time:
            loaded.paths.pop(body.lora_name, None)
            return await _unload_everywhere(registry, body.lora_name)


class RuntimeAdapters:
    """The adapters this gateway loaded at run time (name -> path), given again to a worker whose load poll shows it
    lacks one (restarted, or joined since), under the same lock as the loads and unloads."""

    def __init__(self, registry: WorkerRegistry, lock: asyncio.Lock) -> None:
        self.paths: dict[str, str] = {}
        self._registry = registry
        self._lock = lock
        self._tried: dict[tuple[str, str], float] = {}  # (worker, adapter) -> when last given

    def reconcile(self) -> None:
        """After each load poll (a registry listener, on the event loop): a reload for each lack found."""
        now = time.monotonic()
        for snapshot in self._registry.snapshots():
            if not snapshot.healthy or snapshot.stats is None:
                continue
            held = {a.name for a in snapshot.stats.lora_adapters}
            for name in self.paths.keys() - held:
                key = (snapshot.info.worker_id, name)
                if now - self._tried.get(key, -RELOAD_BACKOFF_S) >= RELOAD_BACKOFF_S:
                    self._tried[key] = now
                    self._registry.spawn(self._reload(*key), name=f"reload-lora-{name}-{key[0]}")

    async def _reload(self, worker_id: str, name: str) -> None:
        async with self._lock:
            path = self.paths.get(name)
            if path is None:  # unloaded meanwhile
                return
            request = serving_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
            reply, error = await _call(self._registry, worker_id, lambda stub: stub.LoadLoRAAdapter(
                request, timeout=_CALL_TIMEOUT_S))
        if reply is not None:
            logger.info("LoRA adapter %r loaded again on worker %s", name, worker_id)
            self._registry.note_lora_adapter(worker_id, name, reply.adapter)
        elif error is not None and not error.startswith("ALREADY_EXISTS"):
            logger.warning("LoRA adapter %r could not be loaded again on worker %s: %s", name, worker_id, error)


async def _load_everywhere(models: ServedModels, registry: WorkerRegistry, body: LoadLoRAAdapterRequest) -> str:
    if body.lora_name in models.base or body.lora_name in registry.lora_adapters():
        raise bad_request(f"the LoRA adapter {body.lora_name!r} has already been loaded", "lora_name")
    workers = _workers(registry)
    request = serving_pb2.LoadLoRAAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path)
    results = await asyncio.gather(*(_call(registry, w, lambda stub: stub.LoadLoRAAdapter(
        request, timeout=_CALL_TIMEOUT_S)) for w in workers))
    failed = [(w, error) for w, (_, error) in zip(workers, results, strict=True) if error is not None]
    if failed:  # all or none: every worker that did or may have loaded it (a timeout, a lost reply) unloads it
        unload = serving_pb2.UnloadLoRAAdapterRequest(lora_name=body.lora_name)
        await asyncio.gather(*(_call(registry, w, lambda stub: stub.UnloadLoRAAdapter(unload, timeout=_CALL_TIMEOUT_S))
                               for w, (_, error) in zip(workers, results, strict=True)
                               if error is None or not error.startswith(_REFUSED)))
        worker_id, error = failed[0]
        message = f"the LoRA adapter {body.lora_name!r} did not load on worker {worker_id}: {error}"
        if all(error.startswith(_REFUSED) for _, error in failed):
            raise bad_request(message, "lora_path")
        raise ApiError(status_code=502, message=message)
    for worker_id, (reply, _) in zip(workers, results, strict=True):
        assert reply is not None
        registry.note_lora_adapter(worker_id, body.lora_name, reply.adapter)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


async def _unload_everywhere(registry: WorkerRegistry, name: str) -> str:
    if name not in registry.lora_adapters():
        raise ApiError(status_code=404, param="lora_name", message=f"the LoRA adapter {name!r} cannot be found")
    workers = _workers(registry)
    request = serving_pb2.UnloadLoRAAdapterRequest(lora_name=name)
    results = await asyncio.gather(*(_call(registry, w, lambda stub: stub.UnloadLoRAAdapter(
        request, timeout=_CALL_TIMEOUT_S)) for w in workers))
    for worker_id, (_, error) in zip(workers, results, strict=True):
        if error is None or error.startswith("NOT_FOUND"):  # gone there either way
            registry.note_lora_adapter(worker_id, name, None)
    errors = [f"{w}: {e}" for w, (_, e) in zip(workers, results, strict=True) if e and not e.startswith("NOT_FOUND")]
    if errors:
        raise ApiError(status_code=502, message=f"the LoRA adapter {name!r} was not unloaded on {'; '.join(errors)}")
    return f"Success: LoRA adapter '{name}' removed successfully."


def _workers(registry: WorkerRegistry) -> list[str]:
    workers = [s.info.worker_id for s in registry.snapshots() if s.healthy]
    if not workers:
        raise ApiError(status_code=503, message="no healthy worker")
    return workers


async def _call(registry: WorkerRegistry, worker_id: str,
                call: Callable[[serving_pb2_grpc.WorkerStub], Awaitable[serving_pb2.LoRAAdapterResponse]]
                ) -> tuple[serving_pb2.LoRAAdapterResponse | None, str | None]:
    """(the worker's reply, None), or (None, why it failed: "CODE: details")."""
    try:
        stub = registry.stub(worker_id)
    except KeyError:
        return None, "UNAVAILABLE: it left the cluster"
    try:
        return await call(stub), None
    except grpc.aio.AioRpcError as error:
        return None, f"{error.code().name}: {error.details() or ''}".strip()
