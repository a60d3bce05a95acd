"""ClusterController on a real Ray cluster (one per module) with stub workers that serve real gRPC `Health`.

Most tests drive the plain class from the test process (its host actors are real Ray actors) and call
`check_health()` themselves; one runs the controller as the Ray actor `serve` uses, with its watch thread.
Run from the repository root: the host actors import `tests.deploy.stub_worker` from there.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray

from deploy.controller import ClusterController, ControllerConfig, RemoteClusterController, init_local_ray
from deploy.worker_host import WorkerInfo
from protos import serving_pb2, serving_pb2_grpc
from tests.deploy.processes import describe, processes_titled
from tests.deploy.stub_worker import UNHEALTHY_FILE_ENV, StubWorkerFactory

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    init_local_ray()
    yield
    ray.shutdown()


def make_controller(**overrides: object) -> ClusterController:
    fields: dict[str, object] = {"health_interval_s": 0.0, "stop_timeout_s": 5.0, "start_timeout_s": 60.0}
    fields.update(overrides)
    return ClusterController(ControllerConfig(**fields), factory=StubWorkerFactory())  # type: ignore[arg-type]


def health(info: WorkerInfo) -> serving_pb2.HealthResponse | None:
    with grpc.insecure_channel(info.endpoint) as channel:
        try:
            return serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=2.0)
        except grpc.RpcError:
            return None


def by_id(infos: list[WorkerInfo]) -> dict[str, WorkerInfo]:
    return {i.worker_id: i for i in infos}


def host_processes() -> list[int]:
    return processes_titled("ray::WorkerHost", under=os.getpid())


def wait_for(predicate, timeout_s: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: pid not in host_processes(), 10.0)


@pytest.fixture
def no_hosts_left() -> Iterator[None]:
    yield
    assert wait_for(lambda: not host_processes(), 15.0), describe(host_processes())


@pytest.mark.usefixtures("no_hosts_left")
def test_start_publishes_healthy_workers_and_shutdown_stops_them() -> None:
    controller = make_controller(num_prefill_workers=1, num_decode_workers=2)
    try:
        infos = controller.start()
        assert [i.worker_id for i in infos] == ["prefill-0", "decode-0", "decode-1"]
        assert [i.role for i in infos] == ["prefill", "decode", "decode"]
        assert len({i.pid for i in infos} | {os.getpid()}) == 4  # a process each, none of them this one
        for info in infos:
            reply = health(info)
            assert reply is not None and reply.ok
            assert (reply.worker_id, reply.role, reply.incarnation) == (info.worker_id, info.role, info.incarnation)
        assert controller.check_health() == []
        assert controller.list_workers() == infos
    finally:
        controller.shutdown()
    assert controller.list_workers() == []
    assert all(health(i) is None for i in infos)
    controller.shutdown()  # idempotent


@pytest.mark.usefixtures("no_hosts_left")
def test_a_killed_worker_comes_back_with_a_new_incarnation_and_endpoint() -> None:
    controller = make_controller(num_prefill_workers=1, num_decode_workers=1)
    try:
        before = by_id(controller.start())
        kill(before["decode-0"].pid)
        assert controller.check_health() == ["decode-0"]
        after = by_id(controller.list_workers())
        assert after.keys() == {"prefill-0", "decode-0"}
        assert after["prefill-0"] == before["prefill-0"]  # untouched
        new, old = after["decode-0"], before["decode-0"]
        assert new.incarnation > old.incarnation
        assert new.endpoint != old.endpoint and new.pid != old.pid
        reply = health(new)
        assert reply is not None and reply.incarnation == new.incarnation
        assert controller.check_health() == []
        assert controller.restart_counts() == [("decode", "process_died", 1)]
    finally:
        controller.shutdown()


@pytest.mark.usefixtures("no_hosts_left")
def test_a_live_worker_failing_its_checks_is_replaced_at_the_threshold(tmp_path: Path) -> None:
    unhealthy = tmp_path / "unhealthy"
    controller = make_controller(
        num_prefill_workers=1,
        num_decode_workers=1,
        num_failed_checks_to_restart=2,
        worker_env={UNHEALTHY_FILE_ENV: str(unhealthy)},  # reaches the host processes through Ray's runtime_env
    )
    try:
        before = by_id(controller.start())
        unhealthy.write_text(before["prefill-0"].endpoint)
        assert controller.check_health() == []  # one failed check: still published
        assert controller.list_workers() == list(before.values())
        assert controller.check_health() == ["prefill-0"]
        after = by_id(controller.list_workers())
        assert after["prefill-0"].incarnation > before["prefill-0"].incarnation
        assert after["decode-0"] == before["decode-0"]
        assert controller.check_health() == []
        assert controller.restart_counts() == [("prefill", "stalled", 1)]  # it answered, but not ok
    finally:
        controller.shutdown()


def _scale_watching_states(controller: ClusterController, role: str, num_workers: int,
                           seen: set[tuple[str, str]]) -> list[WorkerInfo]:
    """`controller.scale(...)` in a thread while this one records what `pool_workers()` shows."""
    import threading

    result: list[list[WorkerInfo]] = []
    thread = threading.Thread(target=lambda: result.append(controller.scale(role, num_workers)))
    thread.start()
    while thread.is_alive():
        seen.update((state, w.worker_id) for state, w in controller.pool_workers())
        seen.update(("listed draining", w.worker_id) for w in controller.list_workers() if w.draining)
        time.sleep(0.001)
    thread.join()
    return result[0]


@pytest.mark.usefixtures("no_hosts_left")
def test_scale_grows_and_shrinks_one_pool_newest_first() -> None:
    controller = make_controller(num_prefill_workers=1, num_decode_workers=1)
    try:
        start = by_id(controller.start())
        seen: set[tuple[str, str]] = set()  # (state, worker_id) as pool_workers() showed them meanwhile
        grown = by_id(_scale_watching_states(controller, "decode", 3, seen))
        assert {("starting", "decode-1"), ("starting", "decode-2")} <= seen
        assert [(state, info) for state, info in controller.pool_workers()] == [
            ("serving", info) for info in grown.values()]
        assert list(grown) == ["prefill-0", "decode-0", "decode-1", "decode-2"]
        assert grown["prefill-0"] == start["prefill-0"] and grown["decode-0"] == start["decode-0"]
        assert all(health(i) is not None for i in grown.values())
        assert controller.pool_sizes() == {"prefill": 1, "decode": 3}

        seen.clear()
        shrunk = by_id(_scale_watching_states(controller, "decode", 1, seen))
        assert {("draining", "decode-1"), ("draining", "decode-2")} <= seen
        # still listed meanwhile, flagged: the router keeps reaching them but routes them nothing new
        assert {("listed draining", "decode-1"), ("listed draining", "decode-2")} <= seen
        assert not any(w.draining for w in controller.list_workers())
        assert {state for state, _ in controller.pool_workers()} == {"serving"}
        assert list(shrunk) == ["prefill-0", "decode-0"]
        assert controller.pool_sizes() == {"prefill": 1, "decode": 1}
        assert health(grown["decode-1"]) is None and health(grown["decode-2"]) is None
        assert wait_for(lambda: len(host_processes()) == 2)

        regrown = by_id(controller.scale("prefill", 2))
        assert list(regrown) == ["prefill-0", "decode-0", "prefill-1"]  # ids are never reused
        assert controller.scale("prefill", 2) == list(regrown.values())  # no-op
        with pytest.raises(ValueError, match="role must be one of"):
            controller.scale("router", 1)
    finally:
        controller.shutdown()


@pytest.mark.usefixtures("no_hosts_left")
def test_inproc_transport_puts_every_worker_in_one_process() -> None:
    controller = make_controller(num_prefill_workers=1, num_decode_workers=2, kv_transport="inproc")
    try:
        infos = controller.start()
        (pid,) = {i.pid for i in infos}
        assert host_processes() == [pid]
        (added,) = [i for i in controller.scale("decode", 3) if i.worker_id == "decode-2"]
        assert added.pid == pid and health(added) is not None
        assert [i.worker_id for i in controller.scale("decode", 1)] == ["prefill-0", "decode-0"]
        assert health(added) is None

        kill(pid)
        assert sorted(controller.check_health()) == ["decode-0", "prefill-0"]
        after = controller.list_workers()
        assert [i.worker_id for i in after] == ["prefill-0", "decode-0"]
        assert len({i.pid for i in after}) == 1 and after[0].pid != pid
        assert all(a.incarnation > b.incarnation for a, b in zip(after, infos))
    finally:
        controller.shutdown()


@pytest.mark.usefixtures("no_hosts_left")
def test_a_failed_start_raises_and_leaves_nothing_running() -> None:
    controller = ClusterController(
        ControllerConfig(num_prefill_workers=1, num_decode_workers=1, health_interval_s=0.0, stop_timeout_s=5.0),
        factory=StubWorkerFactory(fail_roles=("decode",)),
    )
    with pytest.raises(RuntimeError, match=r"decode-0: RuntimeError: stub refuses to build a decode worker"):
        controller.start()
    assert controller.list_workers() == []


@pytest.mark.usefixtures("no_hosts_left")
def test_the_controller_actor_watches_and_restarts_on_its_own() -> None:
    config = ControllerConfig(num_prefill_workers=1, num_decode_workers=1, health_interval_s=0.3, stop_timeout_s=5.0)
    actor = RemoteClusterController.remote(config, factory=StubWorkerFactory())
    try:
        before = by_id(ray.get(actor.start.remote(), timeout=60))
        kill(before["prefill-0"].pid)

        def restarted() -> bool:
            now = by_id(ray.get(actor.list_workers.remote(), timeout=10))
            return "prefill-0" in now and now["prefill-0"].incarnation != before["prefill-0"].incarnation

        assert wait_for(restarted, 30.0)
        after = by_id(ray.get(actor.list_workers.remote(), timeout=10))
        assert after["decode-0"] == before["decode-0"] and health(after["prefill-0"]) is not None
        ray.get(actor.shutdown.remote(), timeout=30)
        assert ray.get(actor.list_workers.remote(), timeout=10) == []
    finally:
        ray.kill(actor)


def test_a_dead_actors_start_error_names_its_exit_type_and_detail() -> None:
    """Ray's first line ("The actor died unexpectedly ...") says nothing of why; the exit lines do."""
    from deploy.controller import _describe

    died = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: WorkerHostProcess\n"
                        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
                        "Worker exit detail: killed by the memory monitor")
    described = _describe(died)
    assert described.startswith("The actor died unexpectedly before finishing this task.")
    assert "Worker exit type: SYSTEM_ERROR" in described and "killed by the memory monitor" in described
    assert "class_name" not in described
    assert _describe(RuntimeError("one line")) == "one line"
