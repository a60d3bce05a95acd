"""The gateway's side of a cluster whose workers a Ray controller runs (deploy/controller.py): its worker
directory and the gateway app over it, shared by `serve` (which starts the cluster) and `gateway --ray-address`
(which finds the head's named controller).

    controller ──list_workers(), restart_counts()──▶ WorkerDirectory ──▶ the router's registry (a thread)
    controller's config: model, block size, context length, mode ──▶ ServedEngine ──▶ build_cluster_gateway_app

Ray is imported only when the directory talks to the controller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deploy.gateway_app import build_gateway_app
from protos.worker_info import WorkerInfo
from router.config import GatewayConfig, ServedEngine

if TYPE_CHECKING:
    from deploy.controller import ControllerConfig


class WorkerDirectory:
    """The router's worker provider: `controller.list_workers()`.

    The router's registry calls it from a thread every refresh interval, so it may block on Ray. Before
    `attach()`, and when the controller is slow, it returns the last list; once the controller actor is gone,
    `lost` turns true and the list stays frozen.
    """

    def __init__(self, *, timeout_s: float = 10.0) -> None:
        self._controller: Any = None
        self._workers: list[Any] = []
        self._restarts: list[tuple[str, str, int]] = []
        self._timeout_s = timeout_s
        self.lost = False

    def attach(self, controller: Any, workers: list[WorkerInfo]) -> None:
        self._workers = list(workers)
        self._controller = controller

    def __call__(self) -> list[Any]:
        if self._controller is None or self.lost:
            return list(self._workers)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            workers, restarts = ray.get([self._controller.list_workers.remote(),
                                         self._controller.restart_counts.remote()], timeout=self._timeout_s)
            self._workers, self._restarts = list(workers), restarts
        except GetTimeoutError:
            pass  # a busy controller: keep the last list
        except RayActorError:
            self.lost = True
        return list(self._workers)

    def scale(self, role: str, num_workers: int) -> None:
        """The admin API's scale (router/admin.py): blocks until the controller resized the pool. RuntimeError
        when it could not (the admin API answers 503 with it)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._controller is None or self.lost:
            raise RuntimeError("the cluster controller is not running")
        try:
            ray.get(self._controller.scale.remote(role, num_workers))
        except RayActorError as exc:
            raise RuntimeError(f"the cluster controller died: {exc}") from None
        try:
            self._workers = list(ray.get(self._controller.list_workers.remote(), timeout=self._timeout_s))
        except GetTimeoutError:
            pass  # resized; a busy controller's list reaches the router on the next refresh

    def pool_sizes(self) -> dict[str, int]:
        """Each pool's configured size, for the autoscaler (router/autoscaler.py); blocks on the controller."""
        import ray

        if self._controller is None or self.lost:
            raise RuntimeError("the cluster controller is not running")
        return dict(ray.get(self._controller.pool_sizes.remote(), timeout=self._timeout_s))

    def pool_workers(self) -> list[Any]:
        """Every worker and its state, for GET /admin/pools."""
        import ray

        from router.admin import PoolWorker

        if self._controller is None or self.lost:
            return []
        listed = ray.get(self._controller.pool_workers.remote(), timeout=self._timeout_s)
        return [PoolWorker(worker_id=w.worker_id, role=w.role, state=state, endpoint=getattr(w, "endpoint", ""),
                           pid=getattr(w, "pid", 0), rank_pids=getattr(w, "rank_pids", ()), incarnation=w.incarnation, node_id=getattr(w, "node_id", ""))
                for state, w in listed]

    def restart_counts(self) -> list[tuple[str, str, int]]:
        """(role, reason, restarts) as of the last refresh, for the router's splitserve:worker_restarts_total."""
        return list(self._restarts)


def build_cluster_gateway_app(config: GatewayConfig, controller: ControllerConfig, directory: WorkerDirectory,
                              redis_url: str | None) -> tuple[Any, Any]:
    """The gateway app for the workers of `controller` (loads the tokenizer), and its access control (None: /v1/*
    open): the engine they run from the controller's config, their cluster secret on every call, `redis_url` the
    prefix index (None: routing by load), and `directory` what the admin API and the autoscaler resize."""
    return build_gateway_app(config, served_engine(controller), directory, auth=controller.auth,
                             redis_url=redis_url, pool_controller=directory)


def served_engine(controller: ControllerConfig) -> ServedEngine:
    """What the gateway serves of the engine the controller's workers run."""
    engine = controller.engine
    return ServedEngine(model=engine.model, load_format=engine.load_format, block_size=engine.block_size,
                        max_model_len=engine.max_model_len, scheduling_policy=engine.scheduling_policy,
                        max_logprobs=engine.max_logprobs,
                        mode="colocated" if controller.num_colocated_workers else "disaggregated")
