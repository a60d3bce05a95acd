"""bench/chaos.py's cluster handle and its faults: what a fault sees of the running cluster (`Cluster`: the admin
API, each worker's GetLoad, /metrics, the KV-cut trigger file, and what differs between the two clusters —
restarting Redis, a worker's host, cutting a host off) and the fault kinds.

A fault is a small class with a `name` and an `inject(cluster, rng)` (the `Fault` protocol); `make_faults` lists
them. Every fault but `partition_host` works on both clusters (bench/chaos_clusters.py): a loopback `splitserve
serve`, and the Helm chart's pods on network namespaces (tests/multihost/), where a worker's pid is still this
machine's (namespaces of the network only) and a host can be cut off.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Protocol

import httpx

from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import ClusterAuth, sync_channel

ADMIN_TOKEN = "chaos-admin-token"
PARTITION_S = 15.0  # how long a partitioned host stays cut off


class Cluster:
    """The running cluster as the faults and the checks see it: the gateway's URL (and the API key its requests
    carry), the admin API, the KV-cut trigger file, the cluster secret (for GetLoad on the workers). A subclass
    (bench/chaos_clusters.py) says how Redis restarts, which host a worker is on, and how a host is cut off."""

    hosts = ""  # "loopback" or "netns"

    def __init__(self, url: str, cut_file: Path, auth: ClusterAuth, sizes: dict[str, int], *,
                 api_key: str | None = None) -> None:
        self.url, self.cut_file, self.auth = url, cut_file, auth
        self.sizes = dict(sizes)  # role -> workers wanted
        self.headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        self.api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # -- what differs between the clusters ------------------------------------------------------------------------
    def restart_redis(self) -> str:
        """Stop the prefix index's Redis, start it again empty at the same address; says what it did."""
        raise NotImplementedError

    def partition_unavailable(self) -> str | None:
        """Why no host can be cut off here (None: one can)."""
        return "every worker runs on this one host (loopback): a partition needs --hosts netns"

    def host_of(self, worker: dict) -> str:
        """The host `worker` (a /admin/pools entry) runs on."""
        raise NotImplementedError

    def cut(self, host: str) -> None:
        raise NotImplementedError

    def heal(self, host: str) -> None:
        raise NotImplementedError

    def supervise(self) -> None:
        """Called while waiting for the cluster to be whole: restart what a supervisor would (the kubelet)."""

    def node_restarts(self) -> dict[str, int]:
        """Each pod's restarts by its supervisor (netns: a Ray node that exited, started again); loopback: none."""
        return {}

    def pools(self) -> list[dict]:
        response = httpx.get(f"{self.url}/admin/pools", headers=self.headers, timeout=30)
        response.raise_for_status()
        return response.json()["workers"]

    def scale(self, **sizes: int) -> list[dict]:
        response = httpx.post(f"{self.url}/admin/scale", headers=self.headers, json=sizes, timeout=600)
        response.raise_for_status()
        self.sizes.update(sizes)
        return response.json()["workers"]

    def load(self, endpoint: str) -> serving_pb2.LoadStats:
        with sync_channel(endpoint, self.auth) as channel:
            return serving_pb2_grpc.WorkerStub(channel).GetLoad(serving_pb2.LoadRequest(), timeout=10)

    def metric(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name}

    def is_whole(self) -> bool:
        """Every pool at its size, every worker serving and answering its health checks."""
        try:
            workers = self.pools()
        except httpx.HTTPError:
            return False
        roles = Counter(w["role"] for w in workers if w["state"] == "serving" and w["load"] and w["load"]["healthy"])
        return len(workers) == sum(self.sizes.values()) and all(roles[r] == n for r, n in self.sizes.items())

    def wait_whole(self, timeout_s: float) -> float:
        """Seconds until the cluster was whole; raises TimeoutError."""
        started = time.monotonic()
        while True:
            self.supervise()
            if self.is_whole():
                break
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the cluster was not whole within {timeout_s} s: {self.pools()}")
            time.sleep(0.5)
        return time.monotonic() - started


class Fault(Protocol):
    """One kind of fault. `inject` does it (blocking until it is over: a SIGSTOP lasts its time, a scale-up and
    -down both complete, a partition is healed) and says what it did, naming its victim; victims are chosen with
    `rng` only. `unavailable(cluster)`: why it cannot be injected on that cluster (None, the default for a fault
    class that subclasses `Fault`: it can)."""

    name: str

    def unavailable(self, cluster: Cluster) -> str | None:
        return None

    def inject(self, cluster: Cluster, rng: random.Random) -> str: ...


def _serving(cluster: Cluster, role: str | None = None) -> list[dict]:
    return sorted((w for w in cluster.pools() if w["state"] == "serving" and (role is None or w["role"] == role)),
                  key=lambda w: w["worker_id"])


class KillPrefill(Fault):
    name = "kill_prefill"

    def inject(self, cluster: Cluster, rng: random.Random) -> str:
        victim = rng.choice(_serving(cluster, "prefill"))
        os.kill(victim["pid"], signal.SIGKILL)
        return f"SIGKILL {victim['worker_id']} (pid {victim['pid']})"


class KillDecodeMidStream(Fault):
    """SIGKILL a decode worker while it runs a stream (the first seen busy within 10 s; else a seeded one)."""

    name = "kill_decode_mid_stream"

    def inject(self, cluster: Cluster, rng: random.Random) -> str:
        decode = _serving(cluster, "decode")
        victim, running, deadline = rng.choice(decode), 0, time.monotonic() + 10
        while time.monotonic() < deadline:
            for worker in rng.sample(decode, len(decode)):
                # killed the moment it is seen busy: a second look first would let a short stream finish meanwhile
                running = cluster.load(worker["endpoint"]).num_requests_running
                if running:
                    victim = worker
                    break
            if running:
                break
            time.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        return f"SIGKILL {victim['worker_id']} (pid {victim['pid']}) running {running} streams"


class StopWorker(Fault):
    """SIGSTOP a worker (either role), SIGCONT it `stop_s` later (unless the controller replaced it meanwhile)."""

    name = "sigstop_worker"

    def __init__(self, stop_s: float) -> None:
        self.stop_s = stop_s

    def inject(self, cluster: Cluster, rng: random.Random) -> str:
        victim = rng.choice(_serving(cluster))
        os.kill(victim["pid"], signal.SIGSTOP)
        time.sleep(self.stop_s)
        try:
            os.kill(victim["pid"], signal.SIGCONT)
            after = "SIGCONT"
        except ProcessLookupError:
            after = "gone before SIGCONT"
        return f"SIGSTOP {victim['worker_id']} (pid {victim['pid']}) {self.stop_s:g} s, {after}"


class RestartRedis(Fault):
    """Stop the prefix index's Redis and start it again empty, on the same port with the same password."""

    name = "restart_redis"

    def inject(self, cluster: Cluster, rng: random.Random) -> str:
        return cluster.restart_redis()


class CutKVTransfer(Fault):
    """Cut the next KV handoff of two or more blocks half-way (prefill_worker's SPLITSERVE_FAULT_KV_CUT_FILE)."""

    name = "cut_kv_transfer"

    def inject(self, cluster: Cluster, rng: random.Random) -> str:
        cluster.cut_file.touch()
        deadline = time.monotonic() + 20
        while cluster.cut_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if cluster.cut_file.exists():
            cluster.cut_file.unlink(missing_ok=True)
            raise RuntimeError("no KV handoff of two or more blocks within 20 s: nothing cut")
        return "cut a KV handoff half-way"


class ScalePool(Fault):
    """Scale a seeded pool up by one, then back down (its new worker serves, then drains away)."""

    name = "scale_up_down"

    def inject(self, cluster: Cluster, rng: random.Random) -> str:
        role = rng.choice(sorted(cluster.sizes))
        size = cluster.sizes[role]
        cluster.scale(**{role: size + 1})
        cluster.scale(**{role: size})
        return f"scaled {role} {size} -> {size + 1} -> {size}"


class PartitionHost(Fault):
    """Cut a seeded host off (a prefill or a decode host: the host of a seeded serving worker of a seeded role) for
    `partition_s`, then heal it. What it had in flight stalls; the gateway's keepalive fails its streams, which
    migrate; the controller gives its workers up and restarts them where there is room (docs/multihost.md). Says
    what became of the host's workers during the cut (kept, or given up and restarted on which host)."""

    name = "partition_host"

    def __init__(self, partition_s: float) -> None:
        self.partition_s = partition_s

    def unavailable(self, cluster: Cluster) -> str | None:
        return cluster.partition_unavailable()

    def inject(self, cluster: Cluster, rng: random.Random) -> str:
        role = rng.choice(sorted(cluster.sizes))
        victim = rng.choice(_serving(cluster, role))
        host = cluster.host_of(victim)
        on_host = {w["worker_id"]: w["incarnation"] for w in _serving(cluster) if cluster.host_of(w) == host}
        cluster.cut(host)
        try:
            time.sleep(self.partition_s)
            # what the controller made of it while the host was away (the gateway, on the head host, answers)
            now = {w["worker_id"]: w for w in cluster.pools()}
        finally:
            cluster.heal(host)
        fates = ", ".join(f"worker {w} {_fate(cluster, now.get(w), i)}" for w, i in on_host.items())
        return f"cut host {host} off for {self.partition_s:g} s, healed; during the cut: {fates}"


def _fate(cluster: Cluster, now: dict | None, incarnation: str) -> str:
    """What became of a worker of incarnation `incarnation`, listed as `now` (None: not listed)."""
    if now is None:
        return "gone from the pools"
    if now["incarnation"] != incarnation:
        return f"given up, restarted on host {cluster.host_of(now)}"
    return "kept" if now["state"] == "serving" else f"kept, {now['state']}"


def make_faults(*, stop_s: float, partition_s: float = PARTITION_S) -> dict[str, Fault]:
    """Every fault kind bench/chaos.py injects, by name (`stop_s`: how long a SIGSTOPped worker stays stopped;
    `partition_s`: how long a partitioned host stays cut off)."""
    faults: list[Fault] = [KillPrefill(), KillDecodeMidStream(), StopWorker(stop_s), RestartRedis(),
                           CutKVTransfer(), ScalePool(), PartitionHost(partition_s)]
    return {f.name: f for f in faults}


def schedule(names: list[str], num_faults: int, rng: random.Random) -> list[str]:
    """`num_faults` fault names: rounds of every name once, each round in a seeded order."""
    order: list[str] = []
    while len(order) < num_faults:
        order += rng.sample(names, len(names))
    return order[:num_faults]
