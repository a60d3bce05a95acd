"""Where a worker process may run, and what it asks Ray for: the pure rules the controller applies to each host
actor it creates (`deploy/controller.py`).

    a node started with `ray start --resources '{"splitserve_decode": 2}'`  ──▶  hosts up to 2 decode workers
    a node started with `ray start --resources '{"splitserve_prefill": 1}'` ──▶  hosts 1 prefill worker

- **Pool resources.** A worker of role R asks for `WORKER_UNITS` (1) of the custom resource `splitserve_R`
  (`splitserve_prefill`, `splitserve_decode`, `splitserve_colocated`) whenever the cluster has any `splitserve_*`
  resource (the layout is in use), so each node's amount is the number of that pool's workers it can hold: a node
  that joins with some adds room to the pool, one that leaves takes its room away, and a pool grows only as far as
  its nodes allow (a scale-up past that, or into a pool with no node yet, waits for a node, up to the controller's
  start timeout). A cluster with no such resource at all (a plain `--ray-address` cluster) places workers
  anywhere, as before — except under `splitserve head` (`by_pool`), which always asks: its pool nodes may join
  after it starts, and a worker placed before they do would land on whatever node came first. The embedded local cluster
  (`init_local_ray`) gives its one node `LOCAL_POOL_UNITS` of each, so `serve` on one machine is unchanged.
- **CPUs and GPUs.** On a joined cluster (`reserve_devices`), a worker asks for its engine's threads as CPUs and,
  on CUDA, one GPU, each for every rank of a tensor-parallel worker, so that Ray's accounting matches what runs on
  each node. A worker's ranks are child processes of its host actor's process (engine/distributed/): they run on
  the actor's node, together, by construction — what a STRICT_PACK placement group would ask Ray for. The embedded local cluster asks for
  none: `serve` splits the machine's cores between its worker processes itself (`--num-threads`), and counting
  them in Ray would stop a scale-up past the core count that the operator asked for on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

POOL_RESOURCE_PREFIX = "splitserve_"
WORKER_UNITS = 1.0  # of its pool's resource, per worker
LOCAL_POOL_UNITS = 1024.0  # each pool's resource on the embedded local cluster: more than any pool there needs


def pool_resource(role: str) -> str:
    """The custom Ray resource of `role`'s pool: "splitserve_prefill", "splitserve_decode", "splitserve_colocated"."""
    return f"{POOL_RESOURCE_PREFIX}{role}"


def local_node_resources(roles: Sequence[str]) -> dict[str, float]:
    """The custom resources the embedded single-node cluster's node gets: room for every pool."""
    return {pool_resource(role): LOCAL_POOL_UNITS for role in roles}


def host_actor_options(
    roles: Sequence[str], *, cluster_resources: Mapping[str, float], reserve_devices: bool, num_threads: int,
    device: str, by_pool: bool = False, ranks: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Ray actor options of a host running one worker per entry of `roles` (one entry, except the in-process KV
    transport's shared host): its pools' resources when the cluster uses them, and on a joined cluster the CPUs
    (engine threads) and GPUs (one per CUDA worker) the workers use. `cluster_resources`: `ray.cluster_resources()`
    now (nodes come and go); `by_pool`: ask for the pools' resources whatever the cluster has now; `ranks`: each
    worker's tensor-parallel size, in `roles`' order (default: 1 each)."""
    resources: dict[str, float] = {}
    if by_pool or any(name.startswith(POOL_RESOURCE_PREFIX) and amount > 0 for name, amount in cluster_resources.items()):
        for role in roles:
            name = pool_resource(role)
            resources[name] = resources.get(name, 0.0) + WORKER_UNITS
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0}
    if resources:
        options["resources"] = resources
    if reserve_devices:
        num_ranks = sum(ranks) if ranks is not None else len(roles)
        options["num_cpus"] = max(1, num_threads) * num_ranks
        if device.startswith("cuda"):
            options["num_gpus"] = num_ranks
    return options
