"""Pods as processes: the chart's own commands start a working cluster (tests/helm/pods.py says what is rewritten
on the way: Service host names and ports, nothing else).

One cluster for the module, as `helm template` renders it with 1 prefill and 1 decode node: the Redis pod (a real
redis-server, its password the Secret's), the head pod (`splitserve head`, its Ray head and the named controller),
the two pool pods (plain `ray start --address ... --resources '{"splitserve_<pool>": 1}' --block`), and the gateway
pod (`splitserve gateway`, its own Ray node). The unmodified `openai` client talks to the gateway; every pod's
probes are run as the kubelet would; Redis refuses a client without the password while the workers publish to it
and the gateway reads it with it; a second `splitserve head` finds the running controller and changes nothing;
SIGTERM stops every pod and leaves nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.helm.chart import RELEASE, render
from tests.helm.pods import REPO_ROOT, LocalCluster

pytest.importorskip("helm_python", reason="the `test` extra installs helm-python-sdk")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.redis]

VALUES = {
    "numThreads": 1,  # two cores for two workers
    "gateway": {"replicas": 1, "args": ["--disagg-prefill-threshold=0"]},  # every prompt through the prefill pod
    "engine": ["--kv-cache-memory=256MiB", "--max-model-len=1024"],
    "secrets": {"apiKey": "sk-test"},
}
READY_GATEWAY = r"^splitserve: serving \S+ on (http://\S+) \(gateway"
READY_HEAD = r"^splitserve: head ready: .*\((.*)\)$"


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("pods")
    local = LocalCluster(render(VALUES), release_prefix=f"{RELEASE}-splitserve-", tmp=tmp)
    assert set(local.pods) == {"redis", "head", "prefill", "decode", "gateway"}
    try:
        # Redis, the head, then one pod at a time once the previous one's raylet listens: Ray nodes wait for the
        # head anyway, and on a small shared host a dozen Ray processes starting at once can starve one past Ray's
        # own start-up timeouts (30 s, fixed); a pod that still fails is restarted, as by the kubelet.
        local.start("redis")
        local.wait_for_port("redis", "redis", timeout_s=60)
        local.start("head")
        local.wait_for_port("head", "gcs", timeout_s=180)
        for name in ("prefill", "decode", "gateway"):
            local.start(name)
            local.wait_for_port(name, "raylet", timeout_s=180)
        local.wait_for_line("head", READY_HEAD, timeout_s=400)
        local.url = local.wait_for_line("gateway", READY_GATEWAY, timeout_s=400).group(1)
        yield local
        # The gateway first: its own Ray node, stopped after the head, waits out a timeout against the gone GCS.
        # Then the pools and the head at once: a pool node drains on SIGTERM until its workers' leases end (Ray
        # waits up to 30 s), and the head's controller stops those workers, so the pools stop in a second or two.
        # Redis last: the controller purges stopped workers' index entries.
        codes = local.stop_all(["gateway"]) | local.stop_all(["prefill", "decode", "head"]) | local.stop_all(["redis"])
        for name, code in codes.items():  # a plain `ray start --block` drains its node on SIGTERM, then exits 1
            assert code in ((0, 1) if name in ("prefill", "decode") else (0,)), \
                f"{name} exited {code} on SIGTERM:\n{local.pods[name].output()}"
        assert local.leftovers() == []
        print("pod restarts:", {n: p.num_restarts for n, p in local.pods.items()})
    finally:
        for name in local.pods:
            local.stop(name, timeout_s=30)
        local.leftovers(timeout_s=5)


def _admin(cluster: LocalCluster, path: str) -> dict:
    request = urllib.request.Request(f"{cluster.url}{path}",
                                     headers={"Authorization": f"Bearer {cluster.secret['admin-token']}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@pytest.fixture
def serving(cluster: LocalCluster) -> LocalCluster:
    """The cluster once its gateway is ready (on a starved host a Ray node can crash at start; its pod is
    restarted, as the kubelet would)."""
    cluster.wait_serving(timeout_s=240)
    return cluster


def test_every_pod_passes_its_probes(serving: LocalCluster) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cluster = serving
    probes = [(name, kind) for name in ("redis", "head", "gateway", "prefill", "decode")
              for kind in ("livenessProbe", "readinessProbe")]
    with ThreadPoolExecutor(len(probes)) as pool:
        results = dict(zip(probes, pool.map(lambda p: cluster.probe(*p), probes)))
    assert [p for p, ok in results.items() if not ok] == [], cluster.describe()


def test_a_chat_completion_goes_through_the_gateway_and_both_pools(serving: LocalCluster) -> None:
    cluster = serving
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.secret["api-key"], max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="smollm2-135m", max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "Name a primary colour."}])
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert 1 <= chat.usage.completion_tokens <= 12
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    # its prompt was prefilled by the prefill worker and its KV moved to the decode worker
    assert 'splitserve:requests_by_prefill_path_total{path="remote"} 1.0' in metrics
    roles = sorted(w["role"] for w in _admin(cluster, "/admin/pools")["workers"])
    assert roles == ["decode", "prefill"]


def test_the_gateway_takes_the_secrets_api_key_only(serving: LocalCluster) -> None:
    """The Secret's `api-key` reaches the gateway (SPLITSERVE_API_KEY): /v1/* refuses a request without it or with
    another key (401), before any worker sees it."""
    cluster = serving
    for headers in ({}, {"Authorization": f"Bearer not-{cluster.secret['api-key']}"}):
        request = urllib.request.Request(f"{cluster.url}/v1/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401, headers
    request = urllib.request.Request(f"{cluster.url}/v1/models",
                                     headers={"Authorization": f"Bearer {cluster.secret['api-key']}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert [m["id"] for m in json.load(response)["data"]] == ["smollm2-135m"]


def _metric(metrics: str, line_start: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(line_start))


def test_redis_takes_the_secrets_password_and_every_component_uses_it(serving: LocalCluster) -> None:
    """The Redis pod refuses a client without the Secret's password (and its own probe, run without it, fails),
    while the workers' KV event publishers write the prefix index and the gateway reads it, both with the password
    the head's URL carries (the controller hands it to them)."""
    import redis

    cluster = serving
    pod = cluster.pods["redis"]
    port = pod.ports[pod.named_ports["redis"]]
    with redis.Redis(port=port) as anyone, pytest.raises(redis.AuthenticationError):
        anyone.ping()
    password = cluster.secret["redis-password"]
    assert len(password) >= 32
    with redis.Redis(port=port, password="not-" + password) as wrong, pytest.raises(redis.AuthenticationError):
        wrong.ping()
    probe = [cluster.rewrite(pod, a) for a in pod.container["readinessProbe"]["exec"]["command"]]
    without = {k: v for k, v in cluster.env(pod).items() if k != "REDISCLI_AUTH"}
    assert subprocess.run(probe, env=without, capture_output=True, timeout=30).returncode != 0
    assert cluster.probe("redis", "readinessProbe")

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.secret["api-key"], max_retries=0, timeout=120)
    client.completions.create(model="smollm2-135m", prompt="The prefix index lives in Redis. " * 8, max_tokens=2)
    worker_ids = {w["worker_id"] for w in _admin(cluster, "/admin/pools")["workers"]}
    with redis.Redis(port=port, password=password, decode_responses=True) as r:
        deadline = time.monotonic() + 60
        while True:  # each worker's publisher writes from a thread of its own, soon after the engine step
            publishers = {w for key in r.scan_iter("splitserve:pi:v1:*:workers") for w in r.hkeys(key)}
            if publishers >= worker_ids or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert publishers == worker_ids
        assert r.keys("splitserve:pi:v1:*:b:*")  # blocks the workers hold, indexed
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert _metric(metrics, "splitserve:prefix_index_up") == 1.0
    assert _metric(metrics, 'splitserve:prefix_index_lookups_total{outcome="ok"}') >= 1
    for outcome in ("error", "down"):
        assert _metric(metrics, f'splitserve:prefix_index_lookups_total{{outcome="{outcome}"}}') == 0, outcome


def test_each_pools_workers_run_on_that_pools_nodes(serving: LocalCluster) -> None:
    cluster = serving
    cluster.remember_trees()
    for worker in _admin(cluster, "/admin/pools")["workers"]:
        pod = cluster.pods[worker["role"]]
        assert worker["pid"] in pod.tree, f"{worker['worker_id']} (pid {worker['pid']}) is not on a {worker['role']} node"


def test_a_second_head_finds_the_running_controller_and_changes_nothing(serving: LocalCluster) -> None:
    """`splitserve head` without --start-ray joins the running cluster: the named controller exists, its pools are
    started, so it only says so and exits 0; no worker is added or restarted."""
    cluster = serving
    before = _admin(cluster, "/admin/pools")["workers"]
    head = cluster.pods["head"]
    argv = [a for a in cluster.argv(head) if not a.startswith(("--start-ray=", "--ready-file="))]
    argv[0] = str(Path(sys.executable).parent / "splitserve")
    result = subprocess.run(argv, env=cluster.env(head), cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "head ready: controller splitserve/splitserve-controller" in result.stdout
    assert "1 prefill, 1 decode workers" in result.stdout
    after = _admin(cluster, "/admin/pools")["workers"]
    key = lambda w: (w["worker_id"], w["incarnation"], w["endpoint"])  # noqa: E731
    assert sorted(map(key, after)) == sorted(map(key, before))
