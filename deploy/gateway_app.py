"""The gateway's own configuration and its app, whatever finds the workers: the Ray controller (`serve`, `gateway
--ray-address`) or a fixed list of worker processes (`gateway --prefill/--decode/--colocated`). No Ray here.

    GatewayConfig (router flags) + ServedEngine (what the workers run) + a WorkerSource ──▶ build_gateway_app
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deploy.serve_args import DEFAULT_DISAGG_PREFILL_THRESHOLD
from protos.cluster_auth import ClusterAuth
from protos.worker_info import WorkerInfo
from router.rate_limit import RateLimits

if TYPE_CHECKING:
    from router.admin import PoolWorker
    from router.autoscaler import AutoscalerConfig
    from router.server import GatewayTls


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """The router's options (`add_gateway_args`' flags), shared by `serve` and `gateway`."""

    host: str = "127.0.0.1"  # the router's HTTP address
    port: int = 8000  # 0: any free port (the ready line names it)
    request_timeout_s: float = 600.0  # one request, gateway queue included
    admission_control: bool = True  # False: every request straight to the workers (vLLM's behaviour)
    max_queued_requests: int | None = None  # the gateway's admission queue; None: derived from the pool
    queue_timeout_s: float = 30.0  # longest wait in the gateway's queue before a 503
    max_migrations: int = 3  # times one request may move to another decode worker after losing its own
    admin_token: str | None = field(default=None, repr=False)  # the admin API's bearer token; None: no admin API
    routing_policy: str = "prefix-aware"
    disagg_prefill_threshold_tokens: int = DEFAULT_DISAGG_PREFILL_THRESHOLD
    # Security (docs/security.md): API keys (none: /v1/* open) and where they come from, per-key rate limits,
    # HTTPS at the gateway. The cluster secret and gRPC TLS are the workers' (`ServedEngine` does not carry them).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: str | None = None
    metrics_require_key: bool = False
    rate_limits: RateLimits = field(default_factory=RateLimits)
    tls: GatewayTls | None = None
    signal_window_s: float = 60.0  # the autoscaling signals' latency window
    autoscaler: AutoscalerConfig | None = None  # the built-in autoscaler; None: the pools keep their sizes


@dataclass(frozen=True, kw_only=True)
class ServedEngine:
    """What the gateway must know of the workers' engine to serve it: from the controller's engine config, or
    from the workers' own Health answers (deploy/static_workers.py)."""

    model: str  # --model: a registered name, a path, or (load_format "dummy") a dummy shape
    load_format: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None  # None: the checkpoint's context length
    mode: str = "disaggregated"  # or "colocated"


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
    return build_router_app(
        model=served.model,
        worker_provider=directory,
        load_format=served.load_format,
        mode=served.mode,
        block_size=served.block_size,
        max_model_len=served.max_model_len,
        request_timeout_s=config.request_timeout_s,
        admission_control=config.admission_control,
        max_queued_requests=config.max_queued_requests,
        queue_timeout_s=config.queue_timeout_s,
        max_migrations=config.max_migrations,
        admin=AdminApi(token=config.admin_token, controller=directory) if config.admin_token else None,
        restart_counts=directory.restart_counts,
        redis_url=redis_url,
        routing_policy=config.routing_policy,
        disagg_prefill_threshold_tokens=config.disagg_prefill_threshold_tokens,
        signal_window_s=config.signal_window_s,
        autoscaler=config.autoscaler,
        pool_controller=pool_controller if config.autoscaler is not None else None,
        auth=auth,
        access=access,
    ), access


def listen(app: Any, config: GatewayConfig) -> Any:
    """The gateway's `router.server.RouterServer` for `app`, its socket bound, not started; ValueError naming the
    address when it cannot listen there (a taken port)."""
    from router.server import RouterServer

    try:
        return RouterServer(app, host=config.host, port=config.port, tls=config.tls)
    except OSError as exc:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None


def reload_keys_on_sighup(access: Any, config: GatewayConfig) -> None:
    """SIGHUP re-reads --api-key-file, as servers do (nothing to do without one)."""
    if access is not None and config.api_key_file is not None:
        signal.signal(signal.SIGHUP, lambda *_: access.ring.reload())
