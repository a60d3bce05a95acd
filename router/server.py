"""Serving the router with uvicorn in this process: in the foreground, or from a background thread that a
caller (the `splitserve serve` command, tests) shuts down programmatically.

    app = build_router_app(GatewayConfig(), ServedEngine(model="smollm2-135m"), workers)   # loads the tokenizer
    run_router(app, host="0.0.0.0", port=8000)       # blocks until SIGINT / SIGTERM

    server = RouterServer(app, host="127.0.0.1", port=0).start()    # returns once it listens
    server = RouterServer(app, tls=GatewayTls(keyfile=..., certfile=...))   # HTTPS (vLLM's --ssl-* flags)
    ... server.url ...
    server.stop()                                    # graceful: the lifespan closes the worker registry
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from engine.request.generation_config import load_generation_defaults
from router.app import create_app
from router.config import GatewayConfig, GatewayTls, RouterConfig, ServedEngine
from router.worker_registry import WorkerProvider, WorkerRegistry

if TYPE_CHECKING:
    from fastapi import FastAPI

    from engine.tokenizer.tokenizer import Tokenizer
    from protos.cluster_auth import ClusterAuth
    from router.admin import AdminApi
    from router.api_keys import AccessControl
    from router.autoscaler import ScalableCluster
    from router.metrics import RestartCounts


# grpc.aio is built for asyncio's own loop; uvicorn would pick uvloop whenever it happens to be installed.
_LOOP = "asyncio"


def build_router_app(
    config: GatewayConfig,
    served: ServedEngine,
    worker_provider: WorkerProvider,
    *,
    auth: ClusterAuth | None = None,
    redis_url: str | None = None,
    access: AccessControl | None = None,
    admin: AdminApi | None = None,
    restart_counts: RestartCounts | None = None,
    pool_controller: ScalableCluster | None = None,
) -> FastAPI:
    """The router app with `config`'s settings, serving `served.model` (a registered name like "smollm2-135m", a
    .gguf path, or an HF directory; with `load_format` "dummy", a dummy shape like "llama-3.2-1b", whose tokenizer
    is the workers') through the workers `worker_provider` lists.

    A factory, so it does I/O: resolves the model (fetching a registered one on first use) and loads its
    tokenizer. The API's names for the model are `config.served_model_names`, else `served.model`; the context
    length `served.max_model_len`, else the checkpoint's. `auth`: the cluster secret (and TLS) of the calls to the
    workers. `redis_url`: the prefix index (None: route by load only). `access`, `admin`, `restart_counts`:
    create_app's (router/app.py); `pool_controller`: what `config.autoscaler` resizes. `config.chat_template`: the
    operator's chat template over the model's (`read_chat_template`).
    """
    from engine.loader.model_registry import resolve_model

    tokenizer, context_length = load_tokenizer(served.model, served.load_format)
    if config.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(read_chat_template(config.chat_template))
    model_path = None if served.load_format == "dummy" else resolve_model(served.model)  # its generation config
    router_config = RouterConfig.serving(
        config, served_model_names=(served.model,), mode=served.mode, block_size=served.block_size,
        scheduling_policy=served.scheduling_policy, max_logprobs=served.max_logprobs,
        max_model_len=served.max_model_len if served.max_model_len is not None else context_length,
        generation_defaults=load_generation_defaults(config.generation_config, model_path,
                                                     config.override_generation_config))
    registry = WorkerRegistry(worker_provider, **({"auth": auth} if auth is not None else {}))
    prefix_index = None
    if redis_url is not None:
        from router.prefix_index_client import PrefixIndexClient
        from router.prefix_routing import PrefixIndex

        prefix_index = PrefixIndex(PrefixIndexClient(redis_url), namespace=registry.hash_namespace,
                                   live_workers=registry.incarnations)
    return create_app(router_config, registry, tokenizer, prefix_index=prefix_index, restart_counts=restart_counts,
                      admin=admin, access=access, pool_controller=pool_controller)


def read_chat_template(value: str) -> str:
    """--chat-template's template, as vLLM reads it: the file `value` names, else `value` itself when it holds a
    Jinja tag. ValueError (naming the flag) for neither, an unreadable file, or a template that does not parse."""
    from engine.tokenizer.chat_template import ChatTemplate

    try:
        is_file = os.path.isfile(value)
    except (OSError, ValueError):  # a template too long for a path, or holding a NUL
        is_file = False
    if is_file:
        try:
            with open(value, encoding="utf-8") as file:
                source = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {value}: {exc}") from None
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"--chat-template: no file {value!r}, and no Jinja template either ({{{{ }}}} or {{% %}})")
    try:
        ChatTemplate(source)
    except ValueError as exc:
        raise ValueError(f"--chat-template: {exc}") from None
    return source


def load_tokenizer(model: str, load_format: str = "auto") -> tuple[Tokenizer, int]:
    """The model's tokenizer and its context length, from a GGUF file or an HF directory, or for a dummy shape
    (`--load-format dummy`) the one its workers use (torch-free)."""
    from engine.loader.model_registry import resolve_model
    from engine.tokenizer.tokenizer import Tokenizer

    if load_format == "dummy":
        from engine.loader.dummy_shapes import dummy_model_config, dummy_tokenizer

        return dummy_tokenizer(model), dummy_model_config(model).max_position_embeddings

    path = resolve_model(model)
    if path.is_dir():
        config = json.loads((Path(path) / "config.json").read_text())
        return Tokenizer.from_hf_dir(path), int(config["max_position_embeddings"])
    from engine.loader.gguf_reader import open_gguf

    reader = open_gguf(path)  # parsed once for both (the fast reader a worker's load uses): parsing dominates
    architecture = reader.get_field("general.architecture").contents()
    context_length = int(reader.get_field(f"{architecture}.context_length").contents())
    return Tokenizer.from_gguf(reader), context_length


def run_router(app: FastAPI, host: str, port: int, *, log_level: str = "info", tls: GatewayTls | None = None) -> None:
    """Serve `app` in the foreground until SIGINT or SIGTERM (uvicorn installs the handlers)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, loop=_LOOP,
                **(tls.uvicorn_options() if tls is not None else {}))  # type: ignore[arg-type]


class RouterServer:
    """uvicorn serving one app from a daemon thread of this process, with its own event loop.

    `port=0` binds any free port; `port` holds the bound one once constructed. `stop()` asks uvicorn to exit
    (open streams get `graceful_shutdown_s` to finish), waits for the lifespan shutdown, and joins the thread.
    """

    def __init__(
        self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
        graceful_shutdown_s: float = 5.0, tls: GatewayTls | None = None,
    ) -> None:
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        if port:  # a fixed port, rebound at once after a restart (its old connections in TIME_WAIT)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Port 0 without SO_REUSEADDR: with it, Linux may hand out an ephemeral port another socket already holds,
        # and uvicorn's listen() then fails with "Address already in use" (seen once in the suite, beside a Ray
        # cluster's many connections).
        self._socket.bind((host, port))
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self.tls = tls
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s,
                                lifespan="on", loop=_LOOP,
                                **(tls.uvicorn_options() if tls is not None else {}))  # type: ignore[arg-type]
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"router-{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterServer:
        """Start serving; returns once uvicorn has started (lifespan done, socket listening)."""
        self._thread.start()
        deadline_s = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"router server failed to start: {self._error!r}")
            if time.monotonic() > deadline_s:
                self.stop()
                raise TimeoutError(f"router server did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut down gracefully and join the thread; idempotent."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._socket.close()

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as error:  # reported by start()
            self._error = error
