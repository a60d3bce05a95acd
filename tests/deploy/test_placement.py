"""Placement rules (pure): which pool resource a host actor asks for, and its CPUs and GPUs."""

from __future__ import annotations

from deploy.placement import host_actor_options, local_node_resources, pool_resource

BOTH_POOLS = {"CPU": 8.0, "splitserve_prefill": 1.0, "splitserve_decode": 2.0}


def test_a_worker_asks_for_its_pools_resource_when_the_cluster_has_it() -> None:
    assert host_actor_options(["decode"], cluster_resources=BOTH_POOLS, reserve_devices=False, num_threads=2,
                              device="cpu") == {"num_cpus": 0, "num_gpus": 0, "resources": {"splitserve_decode": 1.0}}
    assert host_actor_options(["prefill"], cluster_resources=BOTH_POOLS, reserve_devices=False, num_threads=2,
                              device="cpu")["resources"] == {"splitserve_prefill": 1.0}


def test_a_cluster_without_pool_resources_places_anywhere() -> None:
    assert host_actor_options(["decode"], cluster_resources={"CPU": 8.0}, reserve_devices=False, num_threads=2,
                              device="cpu") == {"num_cpus": 0, "num_gpus": 0}


def test_the_head_asks_for_the_pools_resource_before_any_pool_node_joined() -> None:
    assert host_actor_options(["decode"], cluster_resources={"CPU": 8.0}, reserve_devices=True, num_threads=2,
                              device="cpu", by_pool=True)["resources"] == {"splitserve_decode": 1.0}


def test_a_pool_with_no_node_yet_waits_for_one() -> None:
    only_prefill = {"CPU": 8.0, "splitserve_prefill": 1.0}  # the layout is in use, but no decode node (yet)
    assert host_actor_options(["decode"], cluster_resources=only_prefill, reserve_devices=False, num_threads=1,
                              device="cpu")["resources"] == {"splitserve_decode": 1.0}


def test_a_shared_host_asks_for_one_unit_per_worker_of_each_pool() -> None:
    options = host_actor_options(["prefill", "decode", "decode"], cluster_resources=BOTH_POOLS,
                                 reserve_devices=True, num_threads=2, device="cpu")
    assert options == {"num_cpus": 6, "num_gpus": 0, "resources": {"splitserve_prefill": 1.0, "splitserve_decode": 2.0}}


def test_a_joined_cluster_counts_threads_as_cpus_and_one_gpu_per_cuda_worker() -> None:
    options = host_actor_options(["decode"], cluster_resources=BOTH_POOLS, reserve_devices=True, num_threads=4,
                                 device="cuda")
    assert (options["num_cpus"], options["num_gpus"]) == (4, 1)
    # the embedded local cluster reserves nothing: serve splits the cores itself, and may oversubscribe on purpose
    local = host_actor_options(["decode"], cluster_resources=local_node_resources(["prefill", "decode"]),
                               reserve_devices=False, num_threads=4, device="cuda")
    assert (local["num_cpus"], local["num_gpus"]) == (0, 0) and local["resources"] == {"splitserve_decode": 1.0}


def test_resource_names() -> None:
    assert [pool_resource(r) for r in ("prefill", "decode", "colocated")] == [
        "splitserve_prefill", "splitserve_decode", "splitserve_colocated"]
    assert set(local_node_resources(["prefill", "decode", "colocated"])) == {
        "splitserve_prefill", "splitserve_decode", "splitserve_colocated"}
