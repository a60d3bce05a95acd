"""The gateway's app, whatever finds the workers: the Ray controller (`serve`, `gateway --ray-address`) or a fixed
list of worker processes (`gateway --prefill/--decode/--colocated`). No Ray here.

    GatewayConfig (its settings, from the flags: router/config.py) + ServedEngine (what the workers run)
        + a WorkerSource ──▶ build_gateway_app: its API keys and admin API, then router.server.build_router_app
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any, Protocol

from protos.cluster_auth import ClusterAuth
from protos.worker_info import WorkerInfo
from router.config import GatewayConfig, ServedEngine

if TYPE_CHECKING:
    from router.admin import PoolWorker


class WorkerSource(Protocol):
    """The gateway's view of the workers: the registry's provider (called from a thread), the restart counts
    behind splitserve:worker_restarts_total, and what the admin API asks (router/admin.py's PoolController)."""

    def __call__(self) -> list[WorkerInfo]: ...

    def restart_counts(self) -> list[tuple[str, str, int]]: ...

    def scale(self, role: str, num_workers: int) -> None: ...

    def pool_workers(self) -> list[PoolWorker]: ...


def build_gateway_app(config: GatewayConfig, served: ServedEngine, directory: WorkerSource, *,
                      auth: ClusterAuth, redis_url: str | None, pool_controller: Any = None) -> tuple[Any, Any]:
    """The gateway app (loads the tokenizer), and its access control (None: /v1/* open). `auth`: the cluster
    secret every call to a worker carries; `redis_url`: the prefix index (None: route by load); `pool_controller`:
    what the built-in autoscaler resizes (with `config.autoscaler`)."""
    from router.admin import AdminApi
    from router.api_keys import AccessControl, ApiKeyRing
    from router.rate_limit import RateLimiter
    from router.server import build_router_app

    access = None
    if config.api_keys or config.api_key_file:
        access = AccessControl(ring=ApiKeyRing(config.api_keys, key_file=config.api_key_file),
                               limiter=RateLimiter(config.rate_limits) if config.rate_limits.enabled else None,
                               metrics_require_key=config.metrics_require_key)
    admin = AdminApi(token=config.admin_token, controller=directory) if config.admin_token else None
    return build_router_app(config, served, directory, auth=auth, redis_url=redis_url, access=access, admin=admin,
                            restart_counts=directory.restart_counts,
                            pool_controller=pool_controller if config.autoscaler is not None else None), access


def listen(app: Any, config: GatewayConfig) -> Any:
    """The gateway's `router.server.RouterServer` for `app`, its socket bound, not started; ValueError naming the
    address when it cannot listen there (a taken port)."""
    from router.server import RouterServer

    try:
        return RouterServer(app, host=config.host, port=config.port, tls=config.tls,
                            log_level=config.uvicorn_log_level)
    except OSError as exc:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None


def reload_keys_on_sighup(access: Any, config: GatewayConfig) -> None:
    """SIGHUP re-reads --api-key-file, as servers do (nothing to do without one)."""
    if access is not None and config.api_key_file is not None:
        signal.signal(signal.SIGHUP, lambda *_: access.ring.reload())
