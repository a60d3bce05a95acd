"""Workers placed on nodes by pool, on a real multi-node Ray cluster on this machine: `ray start --head` and
`ray start --address ...` processes (each in its own session, killed with it at the end), the controller driven
from this process with stub workers (real gRPC Health, no model).

    head node  {"splitserve_decode": 2}            decode-0, decode-1; never a prefill worker
    node a     {"splitserve_prefill": 1}, joins    prefill-0: the scale to 1 waited for it

The test cluster's nodes run in the token-authentication mode this process already has. Ray fixes a process's
mode when it is first imported or first starts a local cluster: on its own this test runs without tokens
(RAY_AUTH_MODE=disabled in the nodes' environment); after a test that ran `ray.init()` here (which switches this
process to token mode and saves a token under ~/.ray) the nodes run with tokens too. A mismatch kills every actor
the moment it starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray

from deploy.controller import ClusterController, ControllerConfig, init_local_ray
from protos import serving_pb2, serving_pb2_grpc
from tests.deploy.processes import describe, survivors
from tests.deploy.stub_worker import StubWorkerFactory

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = str(Path(sys.executable).with_name("ray"))


def _node_env() -> dict[str, str]:
    """The nodes' environment: this process's, usage stats off, and this process's current auth mode."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNode:
    """One `ray start --block` in a session of its own: stopping kills the session (never `ray stop`, which would
    stop every Ray cluster on the machine)."""

    def __init__(self, args: list[str], resources: dict[str, float], log: Path) -> None:
        self._log = log.open("wb")
        argv = [RAY, "start", "--block", "--disable-usage-stats", "--num-cpus", "4",
                "--object-store-memory", str(80 << 20), "--resources", json.dumps(resources),
                "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
                *args]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=_node_env())

    def stop(self) -> list[int]:
        """Kill the node's whole session (SIGTERM, then SIGKILL after 3 s); the pids left after 15 s more."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(3)  # a node that got SIGTERM drains for up to 30 s: nothing here needs that
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 15
        while (left := survivors({}, session=self.proc.pid)) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        self._log.close()
        return survivors({}, session=self.proc.pid)


def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> Iterator[tuple[str, list[RayNode]]]:
    logs = tmp_path_factory.mktemp("ray-nodes")
    port = _free_port()
    # A temp dir of its own (short: Ray's socket paths must fit 107 bytes), so that this cluster never becomes the
    # one a plain ray.init() on this machine would join.
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    nodes = [RayNode(["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp_dir,
                      "--ray-client-server-port", str(_free_port())], {"splitserve_decode": 2}, logs / "head.txt")]
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                init_local_ray(address=f"127.0.0.1:{port}")
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert time.monotonic() < deadline and nodes[0].proc.poll() is None, (logs / "head.txt").read_text()
                time.sleep(1)
        yield f"127.0.0.1:{port}", nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        left = [pid for node in reversed(nodes) for pid in node.stop()]
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"left behind: {describe(left)}"


def _health(endpoint: str) -> serving_pb2.HealthResponse:
    with grpc.insecure_channel(endpoint) as channel:
        return serving_pb2_grpc.WorkerStub(channel).Health(serving_pb2.HealthRequest(), timeout=5)


def test_workers_land_on_their_pools_nodes_and_a_joining_node_lets_a_pool_grow(head, tmp_path) -> None:
    address, nodes = head
    (head_node,) = ray.nodes()
    controller = ClusterController(
        ControllerConfig(num_prefill_workers=0, num_decode_workers=2, worker_host="0.0.0.0", health_interval_s=0.0,
                         stop_timeout_s=5.0, start_timeout_s=120.0),
        factory=StubWorkerFactory())
    try:
        workers = {w.worker_id: w for w in controller.start()}
        assert {w: i.node_id for w, i in workers.items()} == {"decode-0": head_node["NodeID"],
                                                              "decode-1": head_node["NodeID"]}
        for info in workers.values():  # bound to 0.0.0.0, advertised at the node's address
            assert info.endpoint.rpartition(":")[0] == head_node["NodeManagerAddress"]
            assert _health(info.endpoint).worker_id == info.worker_id

        # No node has room for a prefill worker (the head has CPUs to spare, but not the pool's resource): it waits ...
        result: list = []
        grow = threading.Thread(target=lambda: result.append(controller.scale("prefill", 1)))
        grow.start()
        time.sleep(3.0)
        assert grow.is_alive()
        assert ("starting", "prefill-0") in [(s, w.worker_id) for s, w in controller.pool_workers()]
        # ... until a node joins with room for one: it starts there.
        nodes.append(RayNode(["--address", address], {"splitserve_prefill": 1}, tmp_path / "a.txt"))
        grow.join(150)
        assert not grow.is_alive() and result, "the prefill pool did not grow onto the new node"
        grown = {w.worker_id: w for w in result[0]}
        assert {w: i.node_id for w, i in grown.items() if w != "prefill-0"} == {
            "decode-0": head_node["NodeID"], "decode-1": head_node["NodeID"]}
        listed = {n["NodeID"]: n for n in ray.nodes()}
        node_a = listed.get(grown["prefill-0"].node_id)
        assert node_a is not None and node_a["NodeID"] != head_node["NodeID"], listed
        assert node_a["Resources"].get("splitserve_prefill") == 1, node_a  # the node that joined
        assert _health(grown["prefill-0"].endpoint).worker_id == "prefill-0"
    finally:
        controller.shutdown()
