"""The two clusters bench/chaos.py runs on, each a context manager yielding a started, serving `Cluster`
(bench/chaos_faults.py) and stopping everything it started when it exits:

- `loopback`: one `splitserve serve` (real Ray, 2 + 2 workers, every process on this host), the prefix index in a
  Redis this script owns (deploy/redis_server.py's `EmbeddedRedis`, handed over with `--redis-url`, restarted on
  its port). No host can be cut off.
- `netns`: the Helm chart's own pods on hosts that are Linux network namespaces on one bridge (tests/multihost/:
  a head host with the Ray head, the controller and the gateway; a Redis host; prefill-0, prefill-1, decode-0,
  decode-1, one pool node each; and a spare pool node with room for one worker of each pool, started once the
  pools are placed, where a scale-up or a restart lands while its pool's own hosts are full). Redis restarts as its
  pod (stopped, started again: empty, `--save ""`); a pool node that exits is restarted as the kubelet would,
  whenever the run waits for the cluster to be whole; a host is cut off by setting its link down.

`choose_hosts("auto")` takes netns where namespaces can be made here (root, iproute2) and the chart renders
(helm-python-sdk), loopback otherwise, and says why.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from bench.chaos_faults import ADMIN_TOKEN, Cluster
from deploy.redis_server import EmbeddedRedis
from prefill_worker.worker import FAULT_KV_CUT_FILE_ENV
from protos.cluster_auth import CLUSTER_SECRET_ENV, ClusterAuth
from tests.deploy.processes import ServeProcess, serve_argv
from worker.runtime import FAULT_STEP_SLEEP_ENV

if TYPE_CHECKING:
    from bench.chaos import ChaosConfig
    from tests.multihost.cluster import MultiHostCluster

SIZES = {"prefill": 2, "decode": 2}
NETNS_TAG = "cx"  # tests/multihost/network.py's tag: interface and namespace names of this run


def netns_unavailable() -> str | None:
    """Why the namespace cluster cannot run here (None: it can)."""
    try:
        import helm_python  # noqa: F401 - the `test` extra; the chart is rendered with it
    except ImportError:
        return "helm-python-sdk is not installed (the `test` extra): the chart cannot be rendered"
    from tests.multihost.network import unavailable

    return unavailable()


def choose_hosts(hosts: str) -> tuple[str, str]:
    """("netns" | "loopback", why) for `--hosts` auto, netns or loopback; netns where it cannot run raises."""
    if hosts == "loopback":
        return "loopback", "asked for"
    reason = netns_unavailable()
    if hosts == "netns":
        if reason is not None:
            raise RuntimeError(f"--hosts netns: {reason}")
        return "netns", "asked for"
    if hosts != "auto":
        raise ValueError(f"hosts must be auto, netns or loopback, not {hosts!r}")
    return ("netns", "namespaces can be made here") if reason is None else ("loopback", reason)


# -- loopback ---------------------------------------------------------------------------------------------------------
class LoopbackCluster(Cluster):
    hosts = "loopback"

    def __init__(self, url: str, serve: ServeProcess, redis: EmbeddedRedis, cut_file: Path, auth: ClusterAuth) -> None:
        super().__init__(url, cut_file, auth, SIZES)
        self.serve, self.redis = serve, redis

    def restart_redis(self) -> str:
        self.redis.stop()
        time.sleep(1.0)
        self.redis.start()
        return f"restarted Redis on port {self.redis.port}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_serve(serve: ServeProcess) -> None:
    if serve.proc.poll() is None:
        serve.proc.send_signal(signal.SIGINT)
        try:
            serve.proc.wait(90)
        except Exception:  # noqa: BLE001 - then killed below
            pass
    serve.close()


@contextmanager
def loopback(model: str, config: ChaosConfig, work_dir: Path, log: Callable[[str], None]) -> Iterator[Cluster]:
    redis = EmbeddedRedis(port=_free_port(), password=secrets.token_hex(16)).start()
    auth = ClusterAuth(secret=secrets.token_hex(16))
    cut_file = work_dir / "kv-cut"
    argv = serve_argv(model, "--prefill-workers", str(SIZES["prefill"]), "--decode-workers", str(SIZES["decode"]),
                      "--admin-token", ADMIN_TOKEN, "--redis-url", redis.url, "--max-model-len", "256",
                      "--kv-cache-memory", "32MiB", "--kv-transport", config.transport,
                      "--kv-transfer-timeout", str(config.kv_transfer_timeout_s),
                      "--request-timeout", str(config.request_timeout_s), "--drain-timeout", "30",
                      "--disagg-prefill-threshold", "0",  # every prompt through a prefill worker: KV handoffs
                      "--health-check-interval", "0.5", "--health-check-timeout", "2",
                      "--health-check-failure-threshold", "3")
    env = {CLUSTER_SECRET_ENV: auth.secret, FAULT_KV_CUT_FILE_ENV: str(cut_file),
           FAULT_STEP_SLEEP_ENV: str(config.step_sleep_s)}
    serve = ServeProcess(argv, stderr_path=work_dir / "serve.stderr", env=env)
    try:
        yield LoopbackCluster(serve.wait_ready(600), serve, redis, cut_file, auth)
    except BaseException:
        log(serve.output()[-4000:])
        raise
    finally:
        _stop_serve(serve)
        redis.stop()


# -- network namespaces -----------------------------------------------------------------------------------------------
class NetnsCluster(Cluster):
    hosts = "netns"

    def __init__(self, url: str, pods: MultiHostCluster, cut_file: Path, auth: ClusterAuth, api_key: str) -> None:
        super().__init__(url, cut_file, auth, SIZES, api_key=api_key)
        self.pods = pods
        self.supervise_errors: list[str] = []

    def restart_redis(self) -> str:
        self.pods.stop("redis", timeout_s=30)
        time.sleep(1.0)
        self.pods.start("redis")
        self.pods.wait_for_port("redis", "redis", timeout_s=60)
        return f"restarted the Redis pod on host {self.pods.host_of['redis']}"

    def partition_unavailable(self) -> str | None:
        return None

    def host_of(self, worker: dict) -> str:
        network = self.pods.network
        return next((h for h in network.hosts if network.ip(h) == worker["node"]), worker["node"])

    def cut(self, host: str) -> None:
        self.pods.network.cut(host)

    def heal(self, host: str) -> None:
        self.pods.network.heal(host)

    def supervise(self) -> None:
        self.pods.supervise()
        self.pods.remember_trees()

    def node_restarts(self) -> dict[str, int]:
        return {name: pod.num_restarts for name, pod in self.pods.pods.items()}


def _values(model: str, config: ChaosConfig, api_key: str) -> dict:
    return {
        "model": model,
        "numThreads": 1,
        "kvTransport": config.transport,
        "prefill": {"replicas": SIZES["prefill"]},
        "decode": {"replicas": SIZES["decode"]},
        "gateway": {"replicas": 1, "args": [
            "--disagg-prefill-threshold=0",  # every prompt through a prefill worker: KV handoffs
            f"--request-timeout={config.request_timeout_s}"]},
        "head": {"args": [
            f"--kv-transfer-timeout={config.kv_transfer_timeout_s}", "--drain-timeout=30",
            "--health-check-interval=0.5", "--health-check-timeout=2", "--health-check-failure-threshold=3"]},
        "engine": ["--kv-cache-memory=32MiB", "--max-model-len=256"],
        "secrets": {"apiKey": api_key, "adminToken": ADMIN_TOKEN},
    }


READY_GATEWAY = r"^splitserve: serving \S+ on (http://\S+) \(gateway"
READY_HEAD = r"^splitserve: head ready: .*\((.*)\)$"


@contextmanager
def netns(model: str, config: ChaosConfig, work_dir: Path, log: Callable[[str], None], *,
          tag: str = NETNS_TAG) -> Iterator[Cluster]:
    from tests.helm.chart import RELEASE, render
    from tests.multihost.cluster import SPARE_HOST, MultiHostCluster
    from tests.multihost.network import HostNetwork

    network = HostNetwork(MultiHostCluster.hosts(SIZES, spare=True), tag=tag)
    network.create()
    api_key = secrets.token_hex(16)
    cut_file = work_dir / "kv-cut"
    # the head's controller hands SPLITSERVE_* settings on to every worker
    fault_env = {FAULT_KV_CUT_FILE_ENV: str(cut_file), FAULT_STEP_SLEEP_ENV: str(config.step_sleep_s)}
    pods = MultiHostCluster(render(_values(model, config, api_key)), release_prefix=f"{RELEASE}-splitserve-",
                            tmp=work_dir, network=network, replicas=SIZES, extra_env={"head": fault_env},
                            spare=True)
    try:
        pods.start("redis")
        pods.wait_for_port("redis", "redis", timeout_s=60)
        pods.start("head")
        pods.wait_for_port("head", "gcs", timeout_s=180)
        for name in [*(n for n in pods.pods if n.startswith(("prefill-", "decode-"))), "gateway"]:
            pods.start(name)
            pods.wait_for_port(name, "raylet", timeout_s=180)
        pods.wait_for_line("head", READY_HEAD, timeout_s=400)
        # the head is ready once its pools are placed, one worker on each pool host: now the room a scale-up (or a
        # restart while its pool's hosts are full) lands in
        pods.start(SPARE_HOST)
        pods.wait_for_port(SPARE_HOST, "raylet", timeout_s=180)
        url = pods.wait_for_line("gateway", READY_GATEWAY, timeout_s=400).group(1)
        pods.url = url.replace("0.0.0.0", pods.address(pods.pods["gateway"]))
        pods.wait_serving(timeout_s=240)
        yield NetnsCluster(pods.url, pods, cut_file, ClusterAuth(secret=pods.secret["cluster-secret"]), api_key)
    except BaseException:
        log(pods.describe()[-8000:])
        raise
    finally:
        # as tests/multihost/test_hosts.py stops its pods: the gateway, then the pools and the head at once, Redis
        for host in network.hosts:  # a host the run left cut off
            network.heal(host)
        pods.stop_all(["gateway"])
        pods.stop_all([name for name in pods.pods if name not in ("gateway", "redis")])
        pods.stop_all(["redis"])
        pods.leftovers(timeout_s=5)
        network.close()


def start(hosts: str, model: str, config: ChaosConfig, work_dir: Path,
          log: Callable[[str], None]) -> AbstractContextManager[Cluster]:
    """The context manager of the cluster `hosts` names ("loopback" or "netns")."""
    return {"loopback": loopback, "netns": netns}[hosts](model, config, work_dir, log)
