"""The cluster controller as a named, detached Ray actor: what `splitserve head` creates and `splitserve gateway`
finds, so that no gateway is the controller's parent.

    head:     connect(address) ──▶ get_or_create(config) ──▶ ensure_started() ──▶ workers up
    gateway:  connect(address) ──▶ find() ──▶ config() (model, block size, index) + list_workers() every second

The actor is `NamespaceName/ActorName` (default `splitserve/splitserve-controller`), `lifetime="detached"`: it
outlives the driver that created it and every gateway restart, and goes with the Ray cluster (or `ray.kill`). It
runs on the head's node (the node of the driver that creates it). `get_or_create` is idempotent: a second head
process finds the running controller and leaves it as it is (its config included); `ensure_started` starts the
pools once, however many times it is called.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from deploy.controller import ClusterController, ControllerConfig, init_local_ray
from deploy.ray_node import RayNode
from deploy.serve_args import CONTROLLER_NAME, CONTROLLER_NAMESPACE
from protos.worker_info import WorkerInfo

logger = logging.getLogger(__name__)


class NamedClusterController(ClusterController):
    """A `ClusterController` that starts its pools at most once and tells gateways its config."""

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__(config)
        self._start_lock = threading.Lock()
        self._started = False

    def ensure_started(self) -> list[WorkerInfo]:
        """Start the pools unless they were started; return the published workers. A failed start leaves
        nothing running (as `start`) and may be retried."""
        with self._start_lock:
            if not self._started:
                self.start()
                self._started = True
        return self.list_workers()

    def config(self) -> ControllerConfig:
        return self._config


# A threaded actor, as RemoteClusterController: list_workers answers while a health pass or a scale is busy.
RemoteNamedController = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(NamedClusterController)


def connect(address: str, *, timeout_s: float, node: RayNode | None = None, stop: threading.Event | None = None) -> None:
    """ray.init(address) as a driver, retrying while the cluster comes up (its GCS not yet listening, our own
    node not yet registered). Raises RuntimeError when `timeout_s` passes or `node` (the node we started) died;
    returns early, not connected, when `stop` is set."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            init_local_ray(address=address)
            return
        except (ConnectionError, RuntimeError, TimeoutError, ValueError) as exc:
            if ray.is_initialized():
                ray.shutdown()
            if node is not None and not node.alive():
                raise RuntimeError(f"the Ray node exited (status {node.returncode}) before joining {address}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot join the Ray cluster at {address}: {exc}") from None
            logger.info("waiting for the Ray cluster at %s: %s", address, exc)
        if stop is not None and stop.wait(1.0):
            return
        if stop is None:
            time.sleep(1.0)


def get_or_create(config: ControllerConfig, *, name: str = CONTROLLER_NAME,
                  namespace: str = CONTROLLER_NAMESPACE) -> Any:
    """The named controller: the running one if any (its own config kept; a differing `config` is logged), else
    a new detached one on this driver's node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    controller = RemoteNamedController.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True, scheduling_strategy=here,
    ).remote(config)
    running = ray.get(controller.config.remote())
    if running != config:
        logger.warning("controller %s/%s is already running with another config; it keeps its own", namespace, name)
    return controller


def find(*, name: str = CONTROLLER_NAME, namespace: str = CONTROLLER_NAMESPACE, timeout_s: float,
         stop: threading.Event) -> Any | None:
    """The named controller once it exists (the head may still be starting); None when `stop` is set first.
    Raises RuntimeError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:  # not created yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"no controller {namespace}/{name} in the Ray cluster after {timeout_s:.0f} s "
                                   "(is `splitserve head` running?)") from None
        stop.wait(1.0)
    return None


def is_alive(controller: Any, *, timeout_s: float = 30.0) -> bool:
    """False once the actor is gone (a busy one that does not answer in time counts as alive)."""
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(controller.restart_counts.remote(), timeout=timeout_s)
    except GetTimeoutError:
        return True
    except RayActorError:
        return False
    return True
