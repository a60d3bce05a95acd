"""The cluster controller: starts the prefill, decode and colocated pools as Ray actors, publishes where their
workers are, health-checks them, restarts the dead and scales each pool on its own.

    ClusterController ──creates──▶ host actor (WorkerHost) ──runs──▶ worker(s) ──gRPC──▶ router, other workers
          │  list_workers() ◀── the router's provider polls this
          └─ watch thread: health() on every host; dead or unhealthy → new process, new incarnation, new endpoint

A scale-down drains before it stops: the workers chosen (newest first) are listed `draining` at once (the router
routes them nothing new, and each refuses new requests itself), finish what they hold within `drain_timeout_s`,
then their processes stop; a stream still open then is cut and the gateway resumes it on another decode worker
(router/resumable_stream.py). Their prefix index entries are purged last.

The unit of restart is the host process: a worker that stops answering is replaced together with its process,
since whatever wedged it (a stuck thread, a leaked lock) lives there too. Every new worker gets a fresh
incarnation, so the router and the prefix index can tell the new worker from its predecessor.

`ClusterController` is a plain class (tests drive it directly from the driver); `RemoteClusterController` is
its Ray actor. Ray is imported on loading only here and in `deploy/named_controller.py`; the commands,
`deploy/lifecycle.py` and `deploy/worker_directory.py` import it when they first talk to Ray, so that building the
CLI and the fixed-list gateway never do.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# Every worker's start-up lines matter (which C++ kernels it loaded, where it serves); Ray folds lines that differ
# only in numbers across workers into "[repeated Nx]" unless told not to, and reads this when first imported.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
import ray  # noqa: E402
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError  # noqa: E402

from deploy.placement import host_actor_options, local_node_resources
from deploy.worker_host import LIVE, STALLED, UNRESPONSIVE, WorkerFactory, WorkerHost, WorkerInfo
from engine.config import EngineConfig
from kv_transfer.registry import TRANSPORTS
from protos.cluster_auth import OPEN, ClusterAuth
from protos.worker_info import ROLES, check_role
from worker.config import WorkerConfig
from worker.log_config import configure_logging
from router.config_checks import AT_LEAST_ONE, AT_LEAST_ZERO, POSITIVE, check_fields, checked, one_of

logger = logging.getLogger(__name__)

# Why a worker was restarted (the `reason` label of splitserve:worker_restarts_total): its process died; it failed
# its liveness check N times in a row, answering that its engine loop is stuck or not answering at all; or an
# earlier restart of it failed and this is the retry.
PROCESS_DIED, RESTART_FAILED = "process_died", "restart_failed"
RESTART_REASONS = (PROCESS_DIED, STALLED, UNRESPONSIVE, RESTART_FAILED)


class WorkerHostProcess(WorkerHost):
    """A WorkerHost as the body of its own process: it logs as every splitserve process does (start-up lines
    such as the C++ kernels each worker loaded reach the `serve` terminal through Ray), and knows its Ray node (its
    workers bound to 0.0.0.0 advertise the node's IP address)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        configure_logging()
        super().__init__(*args, node_ip=ray.util.get_node_ip_address(),
                         node_id=ray.get_runtime_context().get_node_id(), **kwargs)


# One actor per worker process; what it asks Ray for (its pool's resource, CPUs, GPUs) is set per actor by
# deploy/placement.py (num_cpus=0 here is the embedded local cluster's choice, explained there). max_restarts=0:
# Ray's own restart would rerun the old config with the old incarnation, so the controller restarts hosts itself.
WorkerHostActor = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(WorkerHostProcess)


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """The pools to start and how workers are configured and watched. No I/O."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    # Each pool's tensor-parallel size where it differs from the engine's (`serve --prefill-tensor-parallel-size`,
    # `--decode-tensor-parallel-size`); None: the engine's.
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    num_prefill_workers: int = checked(AT_LEAST_ZERO, default=1)
    num_decode_workers: int = checked(AT_LEAST_ZERO, default=1)
    num_colocated_workers: int = checked(AT_LEAST_ZERO, default=0)
    kv_transport: str = checked(one_of(TRANSPORTS), default="grpc")
    kv_transfer_timeout_s: float = checked(POSITIVE, default=30.0)
    worker_host: str = "127.0.0.1"  # the address workers bind; a wildcard (0.0.0.0) advertises the node's IP
    # Ask Ray for the CPUs (engine threads) and GPUs each worker uses (deploy/placement.py): on a joined
    # multi-node cluster; the embedded local one oversubscribes its cores on purpose.
    reserve_devices: bool = False
    place_by_pool: bool = False  # always ask for the pool resources (`splitserve head`: pool nodes join later)
    worker_env: Mapping[str, str] = field(default_factory=dict)  # environment of every worker process
    redis_url: str | None = field(default=None, repr=False)  # the workers' prefix index (may hold a password)
    auth: ClusterAuth = OPEN  # the cluster secret and gRPC TLS every worker serves and calls with
    # between watch passes; 0 disables the watch thread (tests call check_health)
    health_interval_s: float = checked(AT_LEAST_ZERO, default=2.0)
    health_timeout_s: float = checked(POSITIVE, default=2.0)  # one worker's Health RPC
    # consecutive failed checks of a live process before it is replaced
    num_failed_checks_to_restart: int = checked(AT_LEAST_ONE, default=3)
    start_timeout_s: float = checked(POSITIVE, default=600.0)  # one host: process start, model load, servers up
    stop_timeout_s: float = checked(POSITIVE, default=10.0)  # graceful stop of one host before its process is killed
    # A worker removed by a scale-down finishes its requests for up to this long before it stops (the rest are
    # migrated by the gateway); 0: stop at once. `serve --drain-timeout`.
    drain_timeout_s: float = checked(AT_LEAST_ZERO, default=30.0)
    max_restart_backoff_s: float = 30.0  # a host that fails to restart is retried after 1, 2, 4 ... s, up to this

    def __post_init__(self) -> None:
        check_fields(self)

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of `role`'s workers: the common one at that pool's tensor-parallel size."""
        size = {"prefill": self.prefill_tensor_parallel_size, "decode": self.decode_tensor_parallel_size}.get(role)
        return self.engine if size is None else dataclasses.replace(self.engine, tensor_parallel_size=size)

    @property
    def shares_one_process(self) -> bool:
        """The in-process KV transport copies between workers of one process, so all of them live in one host."""
        return self.kv_transport == "inproc"


@dataclass(kw_only=True)
class _Host:
    """The controller's record of one host actor. `actor is None` while the host is down awaiting a restart."""

    configs: dict[str, WorkerConfig]  # worker_id -> config of its current incarnation
    actor: Any = None  # ray ActorHandle
    infos: list[WorkerInfo] = field(default_factory=list)  # published; empty while down
    num_failed_checks: int = 0
    restart_backoff_s: float = 0.0
    next_restart_at: float = 0.0  # time.monotonic()


class ClusterController:
    """Starts, watches, scales and stops the worker pools.

    Lifecycle: `start()` once (raises if any initial worker fails to come up, leaving nothing running), then any
    of `list_workers`, `check_health`, `scale` from any thread, then `shutdown()` (idempotent). Mutations (start,
    health passes, scale, shutdown) are serialized; `list_workers` never waits for them.
    """

    def __init__(self, config: ControllerConfig, *, factory: WorkerFactory | None = None) -> None:
        self._config = config
        self._factory = factory
        self._hosts: list[_Host] = []
        self._table_lock = threading.Lock()  # guards _hosts and the infos in it
        self._op_lock = threading.Lock()  # serializes the slow mutations
        self._num_created: dict[str, int] = dict.fromkeys(ROLES, 0)  # worker ids are never reused
        self._last_incarnation = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._restarts: collections.Counter[tuple[str, str]] = collections.Counter()  # (role, reason) -> restarts
        # What a scale call is doing now (guarded by _table_lock): configs being launched (not listed yet), and
        # the workers being drained and stopped (listed with draining=True until they are gone).
        self._starting: list[WorkerConfig] = []
        self._draining: list[WorkerInfo] = []

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> list[WorkerInfo]:
        """Start the initial pools and wait until every worker is up; return the published workers."""
        c = self._config
        with self._op_lock:
            configs = (
                self._new_configs("prefill", c.num_prefill_workers)
                + self._new_configs("decode", c.num_decode_workers)
                + self._new_configs("colocated", c.num_colocated_workers)
            )
            self._launch_new_hosts(configs)
        if c.health_interval_s > 0:
            self._watcher = threading.Thread(target=self._watch, name="controller-watch", daemon=True)
            self._watcher.start()
        return self.list_workers()

    def shutdown(self) -> None:
        """Stop every worker (gracefully, then by killing its process) and the watch thread. Idempotent."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        with self._op_lock:
            with self._table_lock:
                hosts, self._hosts = self._hosts, []
            self._stop_hosts(hosts)

    # -- queries ---------------------------------------------------------------------------------------------
    def list_workers(self) -> list[WorkerInfo]:
        """The workers that are up now, in creation order, then those a scale-down is draining (`draining=True`:
        the router keeps reaching them for the requests they hold, but routes them nothing new). A restarting
        worker is absent until it is healthy."""
        with self._table_lock:
            return [info for host in self._hosts for info in host.infos] + list(self._draining)

    def pool_sizes(self) -> dict[str, int]:
        """Each pool's configured size, a restarting worker included (the autoscaler's count; `list_workers` omits
        a worker while it restarts), a draining one not (a scale-down already decided it goes)."""
        with self._table_lock:
            draining = {info.worker_id for info in self._draining}
            return dict(collections.Counter(c.role for host in self._hosts for w, c in host.configs.items()
                                            if w not in draining))

    def pool_workers(self) -> list[tuple[str, WorkerInfo | WorkerConfig]]:
        """Every worker with its state: ("serving", info) for the published, ("starting", config) for those a
        scale-up is launching, ("draining", info) for those a scale-down is draining and stopping."""
        with self._table_lock:
            return ([("serving", info) for host in self._hosts for info in host.infos]
                    + [("starting", config) for config in self._starting]
                    + [("draining", info) for info in self._draining])

    # -- health ----------------------------------------------------------------------------------------------
    def check_health(self) -> list[str]:
        """One watch pass: probe every live host at once, restart the dead, those that failed their liveness
        check `num_failed_checks_to_restart` times in a row, and the down ones whose backoff has passed. Load and
        busy-ness play no part: only `Health`, which a worker answers apart from its request path. Returns the
        ids of the workers restarted."""
        with self._op_lock:
            if self._stopping.is_set():
                return []
            with self._table_lock:
                hosts = list(self._hosts)
            probes = {id(h): h.actor.health.remote(self._config.health_timeout_s) for h in hosts if h.actor}
            to_restart: list[tuple[_Host, str]] = []
            for host in hosts:
                if host.actor is None:
                    if time.monotonic() >= host.next_restart_at:
                        to_restart.append((host, RESTART_FAILED))
                elif (reason := self._probe_says_restart(host, probes[id(host)])) is not None:
                    to_restart.append((host, reason))
            restarted: list[str] = []
            for host, reason in to_restart:
                if self._stopping.is_set():
                    break
                if self._restart(host, reason):
                    restarted.extend(host.configs)
            return restarted

    def restart_counts(self) -> list[tuple[str, str, int]]:
        """(role, reason, restarts) since start, one per pair that happened; for `splitserve:worker_restarts_total`."""
        with self._table_lock:
            return [(role, reason, n) for (role, reason), n in sorted(self._restarts.items())]

    def _probe_says_restart(self, host: _Host, probe: Any) -> str | None:
        """The reason to restart `host` now, or None."""
        timeout_s = self._config.health_timeout_s * len(host.configs) + 5.0  # the host checks its workers in turn
        try:
            liveness: dict[str, str] = ray.get(probe, timeout=timeout_s)
        except ActorDiedError as exc:
            logger.warning("host of %s died: %s", sorted(host.configs), _first_line(exc))
            return PROCESS_DIED
        except (GetTimeoutError, RayTaskError, RayActorError) as exc:  # RayActorError: unreachable for now
            liveness = {}
            logger.warning("health check of %s failed: %s", sorted(host.configs), _first_line(exc))
        states = {liveness.get(w, UNRESPONSIVE) for w in host.configs}
        if states == {LIVE}:
            host.num_failed_checks = 0
            return None
        host.num_failed_checks += 1
        if host.num_failed_checks < self._config.num_failed_checks_to_restart:
            return None
        return STALLED if STALLED in states else UNRESPONSIVE

    def _restart(self, host: _Host, reason: str) -> bool:
        """Replace the host's process and its workers (new incarnations). On failure the host stays down and is
        retried after a growing backoff. Runs under the op lock."""
        with self._table_lock:
            host.infos = []  # unpublish first: the router must stop sending to the old endpoints now
            for config in host.configs.values():
                self._restarts[(config.role, reason)] += 1
        if host.actor is not None:
            _kill(host.actor)
            host.actor = None
        self._purge_index(host.configs)
        host.configs = {w: replace(c, incarnation=self._new_incarnation()) for w, c in host.configs.items()}
        host.num_failed_checks = 0
        try:
            self._launch_all([host])
        except Exception as exc:
            host.restart_backoff_s = min(max(1.0, 2 * host.restart_backoff_s), self._config.max_restart_backoff_s)
            host.next_restart_at = time.monotonic() + host.restart_backoff_s
            logger.error(
                "restart of %s failed (next try in %.0f s): %s", sorted(host.configs), host.restart_backoff_s, exc
            )
            return False
        host.restart_backoff_s = 0.0
        logger.warning("restarted (%s) %s", reason, ", ".join(f"{i.worker_id}@{i.endpoint}" for i in host.infos))
        return True

    def _purge_index(self, worker_ids: Iterable[str]) -> None:
        """A dead worker's prefix index entries go now, not when its next incarnation first publishes (the
        index is an optimisation: a failure here is logged and restarting goes on)."""
        if self._config.redis_url is None:
            return
        import redis

        from kv_transfer.prefix_index import purge_worker_everywhere

        try:
            with redis.Redis.from_url(self._config.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0) as r:
                for worker_id in worker_ids:
                    removed = purge_worker_everywhere(r, worker_id)
                    logger.info("prefix index: purged %d entries of %s", removed, worker_id)
        except (redis.RedisError, OSError) as exc:
            logger.warning("prefix index: could not purge %s: %s", sorted(worker_ids), exc)

    def _watch(self) -> None:
        while not self._stopping.wait(self._config.health_interval_s):
            try:
                self.check_health()
            except Exception:  # the watcher must outlive any one bad pass
                logger.exception("health pass failed")

    # -- scaling ---------------------------------------------------------------------------------------------
    def scale(self, role: str, num_workers: int) -> list[WorkerInfo]:
        """Grow or shrink the pool of `role` to `num_workers`; the other pools are untouched. Growing returns once
        the new workers serve; shrinking drains the newest workers first (see the module docstring) and returns
        once they are gone. Returns the published workers afterwards."""
        check_role(role)
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        with self._op_lock:
            if self._stopping.is_set():
                raise RuntimeError("the controller is shutting down")
            with self._table_lock:
                current = [(h, w) for h in self._hosts for w, c in h.configs.items() if c.role == role]
            if num_workers > len(current):
                self._grow(self._new_configs(role, num_workers - len(current)))
            elif num_workers < len(current):
                self._shrink(current[num_workers:])
        return self.list_workers()

    def _grow(self, configs: list[WorkerConfig]) -> None:
        with self._table_lock:
            self._starting = list(configs)
        try:
            self._grow_now(configs)
        finally:
            with self._table_lock:
                self._starting = []

    def _grow_now(self, configs: list[WorkerConfig]) -> None:
        shared = self._shared_host()
        if shared is None:
            self._launch_new_hosts(configs)
            return
        if shared.actor is None:
            raise RuntimeError("the shared worker process is down; retry once it has restarted")
        infos = self._get(shared.actor.add.remote(configs), self._config.start_timeout_s)
        with self._table_lock:
            shared.configs.update({c.worker_id: c for c in configs})
            shared.infos.extend(infos)

    def _shrink(self, victims: list[tuple[_Host, str]]) -> None:
        victim_ids = {w for _, w in victims}
        hosts = list({id(h): h for h, _ in victims}.values())
        with self._table_lock:  # draining from now: listed as such, routed nothing new
            self._draining = [replace(i, draining=True) for h in hosts for i in h.infos if i.worker_id in victim_ids]
            for host in hosts:
                host.infos = [i for i in host.infos if i.worker_id not in victim_ids]
        try:
            self._drain(hosts, victim_ids)
            self._shrink_now(hosts, victim_ids)
            self._purge_index(sorted(victim_ids))  # after the stop: a stopped worker publishes nothing more
        finally:
            with self._table_lock:
                self._draining = []

    def _drain(self, hosts: list[_Host], victim_ids: set[str]) -> None:
        """Each victim refuses new requests at once and gets `drain_timeout_s` to finish what it holds."""
        timeout_s = self._config.drain_timeout_s
        started = time.monotonic()
        refs = [h.actor.drain.remote(sorted(victim_ids & h.configs.keys()), timeout_s) for h in hosts if h.actor]
        left: dict[str, int] = {}
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s + 10.0) if refs else ([], [])
        for ref in ready:
            try:
                left.update(ray.get(ref))
            except (RayActorError, RayTaskError) as exc:  # a dead host has nothing to drain
                logger.warning("drain failed: %s", _first_line(exc))
        cut = {w: n for w, n in left.items() if n}
        elapsed_s = time.monotonic() - started
        if cut:  # what the stop will cut, and the gateway resume elsewhere
            logger.warning("drain of %s timed out after %.1f s; requests left: %s", sorted(victim_ids), elapsed_s, cut)
        else:
            logger.info("drained %s in %.1f s", ", ".join(sorted(victim_ids)), elapsed_s)

    def _shrink_now(self, hosts: list[_Host], victim_ids: set[str]) -> None:
        emptied: list[_Host] = []
        with self._table_lock:
            for host in hosts:
                for worker_id in victim_ids & host.configs.keys():
                    del host.configs[worker_id]
                if not host.configs and not self._config.shares_one_process:
                    self._hosts.remove(host)
                    emptied.append(host)
        self._stop_hosts(emptied)
        shared = self._shared_host()
        if shared is not None and shared.actor is not None:
            self._get(shared.actor.remove.remote(sorted(victim_ids)), self._config.stop_timeout_s)

    # -- internals -------------------------------------------------------------------------------------------
    def _new_configs(self, role: str, num_workers: int) -> list[WorkerConfig]:
        c = self._config
        configs = []
        for _ in range(num_workers):
            worker_id = f"{role}-{self._num_created[role]}"
            self._num_created[role] += 1
            configs.append(
                WorkerConfig(
                    worker_id=worker_id,
                    role=role,
                    engine=c.engine_for(role),
                    host=c.worker_host,
                    kv_transport=c.kv_transport,
                    kv_transfer_timeout_s=c.kv_transfer_timeout_s,
                    incarnation=self._new_incarnation(),
                    redis_url=c.redis_url,
                    auth=c.auth,
                )
            )
        return configs

    def _new_incarnation(self) -> int:
        # Wall-clock milliseconds, kept strictly increasing: unique across restarts of the whole cluster too, so
        # index entries a previous run left in Redis never match a worker of this run.
        self._last_incarnation = max(self._last_incarnation + 1, time.time_ns() // 1_000_000)
        return self._last_incarnation

    def _group_into_hosts(self, configs: Sequence[WorkerConfig]) -> list[_Host]:
        if self._config.shares_one_process:
            return [_Host(configs={c.worker_id: c for c in configs})] if configs else []
        return [_Host(configs={c.worker_id: c}) for c in configs]

    def _shared_host(self) -> _Host | None:
        if not self._config.shares_one_process:
            return None
        with self._table_lock:
            return self._hosts[0] if self._hosts else None

    def _launch_new_hosts(self, configs: Sequence[WorkerConfig]) -> None:
        """Start `configs` in new host processes and publish them; all or nothing (runs under the op lock)."""
        hosts = self._group_into_hosts(configs)
        try:
            self._launch_all(hosts)
        except BaseException:
            self._stop_hosts(hosts)
            raise
        with self._table_lock:
            self._hosts.extend(hosts)

    def _launch_all(self, hosts: list[_Host]) -> None:
        """Create the hosts' actors and start their workers concurrently; wait for all. On any failure raise
        `RuntimeError` naming the workers; the hosts that did start keep their actors (the caller stops them)."""
        env = dict(self._config.worker_env)
        common: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
        cluster_resources = ray.cluster_resources()  # now: nodes join and leave
        refs = []
        for host in hosts:
            configs = list(host.configs.values())
            options = host_actor_options([c.role for c in configs], cluster_resources=cluster_resources,
                                         reserve_devices=self._config.reserve_devices,
                                         num_threads=configs[0].engine.num_threads or 1, device=configs[0].engine.device,
                                         by_pool=self._config.place_by_pool,
                                         ranks=[c.engine.tensor_parallel_size for c in configs])
            host.actor = WorkerHostActor.options(**common, **options).remote(configs, factory=self._factory)
            refs.append(host.actor.start.remote())
        deadline = time.monotonic() + self._config.start_timeout_s
        errors = []
        for host, ref in zip(hosts, refs):
            try:
                infos = self._get_unless_stopping(ref, deadline)
            except (GetTimeoutError, RayActorError, RayTaskError) as exc:
                _kill(host.actor)
                host.actor = None
                errors.append(f"{', '.join(host.configs)}: {_describe(exc)}")
                continue
            with self._table_lock:
                host.infos = infos
        if errors:
            raise RuntimeError("workers failed to start: " + "; ".join(errors))

    def _get_unless_stopping(self, ref: Any, deadline: float) -> Any:
        """ray.get until `deadline` (time.monotonic()); a shutdown cuts the wait short (a model load can take
        minutes, and shutdown() waits for the op lock held meanwhile)."""
        while not self._stopping.is_set():
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise GetTimeoutError("timed out")
            ready, _ = ray.wait([ref], timeout=min(0.5, remaining_s))
            if ready:
                return ray.get(ref)
        raise GetTimeoutError("the controller is shutting down")

    def _stop_hosts(self, hosts: Sequence[_Host]) -> None:
        """Stop every host's workers at once, wait up to stop_timeout_s, then kill the processes."""
        live = [h for h in hosts if h.actor is not None]
        refs = [h.actor.stop.remote() for h in live]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self._config.stop_timeout_s)
        for host in live:
            _kill(host.actor)
            host.actor = None
            host.infos = []

    @staticmethod
    def _get(ref: Any, timeout_s: float) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            raise RuntimeError(_describe(exc)) from None


# A threaded actor: list_workers answers while a health pass or a scale is restarting processes.
RemoteClusterController = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(ClusterController)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass


def _describe(exc: BaseException) -> str:
    """The worker's own error, without Ray's wrapping traceback."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayTaskError) and cause is not None:
        return f"{type(cause).__name__}: {cause}"
    # A dead actor's message is a paragraph; its first line ("The actor died unexpectedly ...") says nothing of why,
    # the exit type and detail lines do (out of memory, a crash, a killed process).
    why = [line.strip() for line in str(exc).splitlines() if "exit type" in line.lower() or "exit detail" in line.lower()]
    return "; ".join([_first_line(exc), *why])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Ray waits a fixed 30 s for a new node's raylet to register with its GCS (ray/_private/node.py, not configurable);
# on a loaded machine that can pass, and a second start usually succeeds.
RAY_NODE_START_TIMEOUT = "The current node timed out during startup"
LOCAL_RAY_START_ATTEMPTS = 2


def init_local_ray(*, address: str | None = None) -> None:
    """Start (or, given `address`, join) the Ray cluster the controller runs on, quietly and small.

    - address="local" unless given: always a fresh private cluster, never one another user started with
      `ray start` on this machine (ray.init() would otherwise attach to it, and our shutdown would not be ours).
    - include_dashboard=False, usage stats off: nothing to serve and nothing to phone home.
    - token authentication, Ray's default for a new local cluster, left on; only its notice on every start is
      filtered out (setting RAY_AUTH_MODE here instead would be too late: Ray reads it when first imported).
    - no worker prestart: the host actors need their own environment, so the idle workers Ray would prestart
      (one per core, ~90 MB each) would never be used.
    - object_store_memory=128 MiB: only small control messages pass through the object store.
    - logging_level=WARNING; worker output still reaches the terminal, prefixed by Ray with the actor and pid.
    - worker_niceness=0 (Ray's default is 15); a cluster joined by address keeps its own setting.
    - the one node gets every pool's resource (deploy/placement.py), so it hosts every pool's workers.
    - a node whose raylet does not register within Ray's fixed 30 s is started once more.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    auth_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if _drop_auth_notice not in auth_logger.filters:
        auth_logger.addFilter(_drop_auth_notice)
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    for attempt in range(1, LOCAL_RAY_START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",
                include_dashboard=False,
                logging_level=logging.WARNING,
                object_store_memory=128 << 20,
                resources=local_node_resources(ROLES),
                # worker_niceness 0: Ray starts its workers at nice 15 by default, which on a busy machine hands the
                # CPU to everything else first; our workers are the serving path.
                _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                                "worker_niceness": 0},
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if attempt == LOCAL_RAY_START_ATTEMPTS or not str(exc).startswith(RAY_NODE_START_TIMEOUT):
                raise
            logger.warning("the local Ray node did not register within Ray's fixed 30 s (a loaded machine?); "
                           "starting it again (attempt %d of %d)", attempt + 1, LOCAL_RAY_START_ATTEMPTS)
            ray.shutdown()  # the half-started node's processes


def _drop_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")
