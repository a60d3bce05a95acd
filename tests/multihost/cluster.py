"""The Helm chart's pods on several hosts: tests/helm/pods.py's `LocalCluster` (the chart's own commands, as the
kubelet runs them), each pod on a host of a `HostNetwork` (tests/multihost/network.py) instead of all on loopback.

    head host       head (Ray head, the controller), gateway (its own Ray node)
    redis host      redis (on a host of its own, so that a test can cut it off alone)
    prefill-i       one prefill pool pod each (`ray start --resources '{"splitserve_prefill": 1}'`)
    decode-i        one decode pool pod each

    spare           (optional) one more pool node, with room for a worker of each pool: where a scale-up lands

A pool Deployment of N replicas becomes N pods (`prefill-0`, `prefill-1`, ...), each on its own host. A Service's
`name:port` becomes its pod's host IP and port; pods on one host (the head's) keep the port moves of
`LocalCluster`, so that their Ray nodes do not collide. Workers bind 0.0.0.0 and advertise their host's IP, as on
Kubernetes (`--ray-address` makes `--worker-host 0.0.0.0` the default).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from tests.helm.pods import LocalCluster, Pod, free_port
from tests.multihost.network import HostNetwork

HEAD_HOST = "head"
REDIS_HOST = "redis"
POOLS = ("prefill", "decode")
SPARE_HOST = "spare"


class MultiHostCluster(LocalCluster):
    transport = ""  # the cluster's --kv-transport (for the tests' bookkeeping)

    def __init__(self, objects: list[dict[str, Any]], *, release_prefix: str, tmp: Path, network: HostNetwork,
                 replicas: dict[str, int], extra_env: dict[str, dict[str, str]] | None = None,
                 spare: bool = False) -> None:
        """`extra_env`: environment entries added to a pod's (by pod name), e.g. a fault hook on the head, whose
        controller hands SPLITSERVE_* settings on to every worker. `spare`: a pod `spare` on a host of its own, a
        pool node with one unit of each pool's resource (the network needs `hosts(replicas, spare=True)`); the test
        starts it when it wants the room (after the pools are placed, say)."""
        super().__init__(objects, release_prefix=release_prefix, tmp=tmp)
        self.network = network
        self.extra_env = extra_env or {}
        self.host_of: dict[str, str] = {}
        taken = {port for pod in self.pods.values() for port in pod.ports.values()}
        if spare:
            template = self.pods["prefill"]
            room = json.dumps({f"splitserve_{pool}": 1 for pool in POOLS})
            args = [f"--resources={room}" if a.startswith("--resources=") else a
                    for a in template.container["args"]]
            assert args != template.container["args"], template.container["args"]
            (template.tmp.parent / SPARE_HOST).mkdir()
            self.pods[SPARE_HOST] = dataclasses.replace(
                template, name=SPARE_HOST, container=template.container | {"args": args},
                tmp=template.tmp.parent / SPARE_HOST, log=template.log.with_name(f"{SPARE_HOST}.log"),
                ports={p: free_port(taken=taken) for p in template.ports}, tree={})
            self.host_of[SPARE_HOST] = SPARE_HOST
        for pool in POOLS:
            template = self.pods.pop(pool)
            for i in range(replicas[pool]):
                name = f"{pool}-{i}"
                pod_tmp = template.tmp.parent / name
                pod_tmp.mkdir()
                self.pods[name] = dataclasses.replace(
                    template, name=name, tmp=pod_tmp, log=template.log.with_name(f"{name}.log"),
                    ports={p: free_port(taken=taken) for p in template.ports}, tree={})
                self.host_of[name] = name
        self.host_of["redis"] = REDIS_HOST
        for name in self.pods:
            self.host_of.setdefault(name, HEAD_HOST)
        owner = {port: pod for pod in self.pods.values() for port in pod.ports.values()}
        for service, local in self.services.items():
            port = int(local.rsplit(":", 1)[1])
            self.services[service] = f"{self.address(owner[port])}:{port}"

    @staticmethod
    def hosts(replicas: dict[str, int], *, spare: bool = False) -> list[str]:
        """The hosts a cluster of these pool sizes needs: the head's, Redis's, one per pool pod (and the spare)."""
        return [HEAD_HOST, REDIS_HOST, *(f"{pool}-{i}" for pool in POOLS for i in range(replicas[pool])),
                *([SPARE_HOST] if spare else [])]

    def exec_prefix(self, pod: Pod) -> list[str]:
        return self.network.exec_prefix(self.host_of[pod.name])

    def env(self, pod: Pod) -> dict[str, str]:
        return super().env(pod) | self.extra_env.get(pod.name, {})

    def address(self, pod: Pod) -> str:
        return self.network.ip(self.host_of[pod.name])

    def host_ips(self, pool: str) -> set[str]:
        return {self.address(pod) for name, pod in self.pods.items() if re.fullmatch(rf"{pool}-\d+", name)}
