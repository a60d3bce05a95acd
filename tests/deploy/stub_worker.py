"""A real-gRPC stand-in for the prefill and decode workers: it serves `Health` and `GetLoad` of the `Worker`
service and nothing else, so the controller and `splitserve serve` are testable without loading a model.

Ray ships `StubWorkerFactory` to the host actors by reference: they import this module from the driver's working
directory, which Ray puts on their path (run pytest from the repository root).
"""

from __future__ import annotations

import os
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from engine.config import EngineConfig
from protos import serving_pb2, serving_pb2_grpc
from worker.config import WorkerConfig

UNHEALTHY_FILE_ENV = "STUB_UNHEALTHY_FILE"


class _Servicer(serving_pb2_grpc.WorkerServicer):
    def __init__(self, worker: StubWorker) -> None:
        self._worker = worker

    def Health(self, request, context):  # noqa: N802 (gRPC's names)
        w = self._worker
        return serving_pb2.HealthResponse(
            ok=not w.told_unhealthy(), worker_id=w.worker_id, role=w.role, model=w.model, incarnation=w.incarnation
        )

    def GetLoad(self, request, context):  # noqa: N802
        w = self._worker
        return serving_pb2.LoadStats(worker_id=w.worker_id, role=w.role, incarnation=w.incarnation)


class StubWorker:
    """Has the real workers' surface: start() -> endpoint, stop(), worker_id, role, endpoint, incarnation."""

    def __init__(self, config: WorkerConfig, checkpoint: object = None) -> None:
        self.worker_id = config.worker_id
        self.role = config.role
        self.incarnation = config.incarnation
        self.model = config.engine.model
        self.checkpoint = checkpoint
        self.endpoint = ""
        self._host = config.host
        self._advertise_host = config.advertise_host or config.host
        self._port = config.port
        self._server: grpc.Server | None = None

    def start(self) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        serving_pb2_grpc.add_WorkerServicer_to_server(_Servicer(self), server)
        port = server.add_insecure_port(f"{self._host}:{self._port}")
        server.start()
        self._server = server
        self.endpoint = f"{self._advertise_host}:{port}"
        return self.endpoint

    def told_unhealthy(self) -> bool:
        """True when the file named by $STUB_UNHEALTHY_FILE lists this worker's endpoint: a test's way to make a
        live worker fail its health checks (a restarted one has a new endpoint, so it is healthy again)."""
        path = os.environ.get(UNHEALTHY_FILE_ENV)
        if not path or not os.path.exists(path):
            return False
        with open(path) as f:
            return self.endpoint in f.read().split()

    def drain(self, timeout_s: float) -> int:
        self.drained = True  # serves no requests: nothing to wait for
        return 0

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None


@dataclass(frozen=True, kw_only=True)
class StubCheckpoint:
    model: str
    pid: int


@dataclass(frozen=True, kw_only=True)
class StubWorkerFactory:
    """Builds `StubWorker`s. `fail_roles`: building a worker of these roles raises (a model that fails to load);
    `load_delay_s`: the "checkpoint load" takes this long (a slow start to interrupt)."""

    fail_roles: tuple[str, ...] = ()
    load_delay_s: float = 0.0

    def load_checkpoint(self, engine: EngineConfig) -> StubCheckpoint:
        time.sleep(self.load_delay_s)
        return StubCheckpoint(model=engine.model, pid=os.getpid())

    def build(self, config: WorkerConfig, checkpoint: StubCheckpoint) -> StubWorker:
        if config.role in self.fail_roles:
            raise RuntimeError(f"stub refuses to build a {config.role} worker")
        return StubWorker(config, checkpoint)
