"""`splitserve serve`: the whole cluster from one command.

    flags ──▶ ServeConfig ──▶ router app, its socket bound ──▶ local Ray ──▶ ClusterController actor
                                                                                 │ starts, waits healthy
                                                                                 ▼
                              router (uvicorn thread, this process)       worker actors (WorkerHost)
                                  └─ registry ── WorkerDirectory ── list_workers() ─┘
    prints "splitserve: serving <model> on http://host:port (...)" once all of it is up

Shutdown (SIGINT or SIGTERM; a second one forces the exit): router stops accepting and drains briefly, the
controller stops every worker, then its actor and Ray itself go. Exit status 0 after a clean shutdown, 1 when
the cluster failed (workers that do not start, a dead controller, a router that cannot serve), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deploy.autoscale_args import AUTOSCALE_WINDOW, add_autoscale_args
from deploy.cuda_probe import cuda_device_count
from deploy.gateway_app import listen, reload_keys_on_sighup
from deploy.lifecycle import (
    ShutdownSignals,
    StartFailed,
    describe_pools,
    reap_descendants,
    run_until_signalled,
    stop_controller,
    wait_for,
)
from deploy.redis_server import EmbeddedRedis, RedisUnavailableError, check_redis
from deploy.serve_args import (
    add_gateway_args,
    add_index_args,
    add_pool_args,
    gateway_config_from_args,
    pools_from_args,
)
from deploy.worker_directory import WorkerDirectory, build_cluster_gateway_app
from engine.engine_args import add_engine_args
from kv_transfer.native_build import cpu_kernels_disabled, recorded_ready

if TYPE_CHECKING:
    from deploy.controller import ControllerConfig
    from deploy.worker_host import WorkerFactory
    from router.config import GatewayConfig


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The gateway's config and the cluster it fronts."""

    gateway: GatewayConfig
    controller: ControllerConfig
    ray_address: str | None = None  # None: a private local Ray cluster, started and stopped with the command
    # The prefix index: an embedded redis-server started with the command (the default), a Redis of your own
    # (`redis_url`), or none (`prefix_index=False`: routing by load only).
    prefix_index: bool = True
    redis_url: str | None = None


# -- flags ---------------------------------------------------------------------------------------------------
# In groups, so that `splitserve head` (the pools) and `splitserve gateway` (the router) take the very flags `serve`
# takes for their part of the cluster.
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the router and the prefill/decode worker pools on Ray")
    add_gateway_args(p)
    add_pool_args(p)
    add_index_args(p)
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster instead of starting a local one; nodes started with "
                        "--resources '{\"splitserve_prefill\": N}' (or splitserve_decode) host only that pool's "
                        "workers, N of them")
    add_autoscale_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Validate the flags and build the config. Raises ValueError naming the bad flag."""
    controller, autoscaler = pools_from_args(args, autoscale=True)
    gateway = gateway_config_from_args(args, flags=(AUTOSCALE_WINDOW,), autoscaler=autoscaler)
    return ServeConfig(gateway=gateway, controller=controller, ray_address=args.ray_address,
                       prefix_index=args.prefix_index, redis_url=args.redis_url)


def run(args: argparse.Namespace) -> int:
    config = serve_config_from_args(args)
    from engine.loader.model_registry import resolve_model

    # Here, once: a bad --model fails before Ray starts (exit 2), and the first use's download happens in one
    # process instead of racing in every worker.
    engine = config.controller.engine
    if engine.load_format == "dummy":  # its tokenizer, fetched here where it is a known model's (else a stand-in)
        from engine.loader.dummy_shapes import dummy_tokenizer

        dummy_tokenizer(engine.model)  # an unknown shape fails here
    else:
        resolve_model(engine.model)
    require_device(engine.device)
    build_kernels_ahead()
    return serve(config)


def require_device(device: str) -> None:
    """Fail before Ray starts when --device names cuda and this machine has none. "auto" and "cpu" need no check;
    each worker's engine resolves its device again (engine/device.py)."""
    if device.startswith("cuda") and cuda_device_count() == 0:
        raise ValueError(f"--device {device}: no CUDA GPU is visible on this machine; use --device cpu or auto")


def build_kernels_ahead() -> None:
    """Compile the C++ CPU kernels once, here, before any worker starts: the workers then only load them, and
    the first request after /health turns 200 costs what any other does. In a child process (this one stays
    torch-free), its report on stderr; not at all when build-kernels last recorded every kernel built for this
    machine (deploy/setup.sh runs it). A failed build is reported and serving goes on: the workers' engines run
    the torch ops instead (see kv_transfer/native_build.py)."""
    if cpu_kernels_disabled() or recorded_ready():
        return
    command = [sys.executable, "-m", "deploy.cli", "build-kernels"]
    sys.stderr.flush()
    if subprocess.run(command, stdin=subprocess.DEVNULL, stdout=2, check=False).returncode:  # its report: stderr
        print("splitserve: warning: the C++ CPU kernels did not build; the workers run torch ops instead",
              file=sys.stderr, flush=True)


# -- the lifecycle -------------------------------------------------------------------------------------------
def serve(config: ServeConfig, *, factory: WorkerFactory | None = None) -> int:
    """Run the cluster until a shutdown signal; return the exit status. Must run in the main thread.

    `factory` builds the workers (default: the real prefill and decode workers); tests pass stand-ins.
    """
    import ray

    from deploy.controller import RemoteClusterController, init_local_ray

    directory = WorkerDirectory()
    redis, redis_url = _start_prefix_index(config)
    if redis is None and redis_url is not None:
        check_redis(redis_url)  # a wrong password or an unreachable server fails here, clearly, before any worker
    c = dataclasses.replace(config.controller, redis_url=redis_url)
    # The router first (it loads only the tokenizer) and its socket bound: a taken port fails in a second,
    # before any worker loads the model.
    try:
        app, access = build_cluster_gateway_app(config.gateway, c, directory, redis_url)
    except BaseException:
        if redis is not None:
            redis.stop()
        raise
    try:
        server = listen(app, config.gateway)
    except ValueError:
        if redis is not None:
            redis.stop()
        raise
    signals = ShutdownSignals()
    signals.install()
    reload_keys_on_sighup(access, config.gateway)
    controller = None
    try:
        init_local_ray(address=config.ray_address)
        signals.install()  # ray.init installs its own SIGTERM handler; ours goes back on top
        controller = RemoteClusterController.remote(c, factory=factory)
        workers = wait_for(controller.start.remote(), signals.requested)
        if workers is None:
            return 0  # asked to stop while starting
        directory.attach(controller, workers)
        try:
            server.start(timeout_s=60.0)
        except (RuntimeError, TimeoutError) as exc:
            raise StartFailed(str(exc)) from None
        print(f"splitserve: serving {c.engine.model} on {server.url} ({describe_pools(workers)}); Ctrl-C to stop",
              flush=True)  # fmt: skip
        return run_until_signalled(signals.requested,
                                   lambda: "the cluster controller died" if directory.lost else None)
    except StartFailed as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()  # stop taking requests first; in-flight ones get the router's grace period
        if controller is not None:
            stop_controller(controller)
        if ray.is_initialized():
            ray.shutdown()
        if redis is not None:
            redis.stop()
        reap_descendants(grace_s=5.0)  # a safety net: ray.shutdown() normally leaves nothing
        signals.restore()


def _start_prefix_index(config: ServeConfig) -> tuple[Any, str | None]:
    """(the embedded Redis, or None; the index's URL, or None without an index)."""
    if not config.prefix_index:
        return None, None
    if config.redis_url is not None:
        return None, config.redis_url
    from protos.cluster_auth import generate_secret

    try:  # a random password: other local users must not read or poison the index
        redis = EmbeddedRedis(password=generate_secret().replace("-", "").replace("_", "")).start()
    except RedisUnavailableError as exc:
        raise ValueError(f"the prefix index needs Redis: {exc} (or --no-prefix-index)") from None
    return redis, redis.url
