"""WorkerHost in this process with stub workers: shared checkpoint, all-or-nothing start, health, stop."""

from __future__ import annotations

import os

import grpc
import pytest

from deploy.worker_host import LIVE, UNRESPONSIVE, WorkerHost
from engine.config import EngineConfig
from protos import serving_pb2, serving_pb2_grpc
from tests.deploy.stub_worker import StubCheckpoint, StubWorker, StubWorkerFactory
from worker.config import WorkerConfig


class RecordingFactory:
    """A StubWorkerFactory that counts checkpoint loads and keeps the workers it built."""

    def __init__(self, fail_roles: tuple[str, ...] = ()) -> None:
        self._stub = StubWorkerFactory(fail_roles=fail_roles)
        self.loads: list[str] = []
        self.built: list[StubWorker] = []

    def load_checkpoint(self, engine: EngineConfig) -> StubCheckpoint:
        self.loads.append(engine.model)
        return self._stub.load_checkpoint(engine)

    def build(self, config: WorkerConfig, checkpoint: StubCheckpoint) -> StubWorker:
        worker = self._stub.build(config, checkpoint)
        self.built.append(worker)
        return worker


def configs(*roles: str) -> list[WorkerConfig]:
    return [WorkerConfig(worker_id=f"{role}-{i}", role=role, incarnation=7) for i, role in enumerate(roles)]


def answers_health(endpoint: str) -> bool:
    with grpc.insecure_channel(endpoint) as channel:
        try:
            serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return True


def test_workers_share_one_checkpoint_and_report_healthy() -> None:
    factory = RecordingFactory()
    host = WorkerHost(configs("prefill", "decode", "decode"), factory=factory)
    try:
        infos = host.start()
        assert [i.worker_id for i in infos] == ["prefill-0", "decode-1", "decode-2"]
        assert [i.role for i in infos] == ["prefill", "decode", "decode"]
        assert {i.pid for i in infos} == {os.getpid()} and {i.incarnation for i in infos} == {7}
        assert len({i.endpoint for i in infos}) == 3
        assert factory.loads == ["smollm2-135m"]  # one load for the three workers
        assert len({id(w.checkpoint) for w in factory.built}) == 1
        assert host.health(timeout_s=2.0) == {"prefill-0": LIVE, "decode-1": LIVE, "decode-2": LIVE}
    finally:
        host.stop()
    assert host.infos() == [] and host.health() == {}
    assert not any(answers_health(i.endpoint) for i in infos)
    host.stop()  # idempotent


def test_failed_start_stops_the_workers_already_started() -> None:
    factory = RecordingFactory(fail_roles=("decode",))
    host = WorkerHost(configs("prefill", "decode"), factory=factory)
    with pytest.raises(RuntimeError, match="stub refuses to build a decode worker"):
        host.start()
    assert host.infos() == []
    (prefill,) = factory.built
    assert prefill.endpoint and not answers_health(prefill.endpoint)


def test_a_worker_whose_server_died_is_unhealthy() -> None:
    factory = RecordingFactory()
    host = WorkerHost(configs("prefill", "decode"), factory=factory)
    try:
        host.start()
        factory.built[1].stop()  # the decode worker's server goes away underneath the host
        assert host.health(timeout_s=1.0) == {"prefill-0": LIVE, "decode-1": UNRESPONSIVE}
    finally:
        host.stop()


def test_add_and_remove() -> None:
    host = WorkerHost(factory=RecordingFactory())
    try:
        assert host.start() == []
        (added,) = host.add([WorkerConfig(worker_id="decode-5", role="decode")])
        assert added.worker_id == "decode-5" and answers_health(added.endpoint)
        with pytest.raises(ValueError, match="already running"):
            host.add([WorkerConfig(worker_id="decode-5", role="decode")])
        host.remove(["decode-5", "no-such-worker"])
        assert host.infos() == [] and not answers_health(added.endpoint)
    finally:
        host.stop()


def test_duplicate_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate worker ids"):
        WorkerHost([WorkerConfig(worker_id="a", role="decode"), WorkerConfig(worker_id="a", role="prefill")])
