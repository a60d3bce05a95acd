"""The cluster on several hosts: the Helm chart's pods (tests/multihost/cluster.py) on five network namespaces, each
its own IP on one bridge — the head host (Redis, the Ray head and controller, the gateway), two prefill hosts and
two decode hosts whose Ray nodes join with their pool's resource, as the README describes.

Over each transport that crosses hosts (grpc, torch/gloo), requests through the gateway from outside (the test,
on the bridge) get the offline engine's greedy answers; every worker runs on a host of its pool and advertises
that host's IP (`/admin/pools`), the prefix index holds the blocks of workers on those hosts, and KV crossed from
prefill hosts to decode hosts. Where namespaces cannot be made (no root, no iproute2), the module is skipped with
the reason; the project's CI runs as root, where they can.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from tests.helm.chart import RELEASE, render
from tests.multihost.cluster import MultiHostCluster
from tests.multihost.network import HostNetwork, unavailable

pytest.importorskip("helm_python", reason="the `test` extra installs helm-python-sdk")
REASON = unavailable()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.redis]

# grpc on 2 + 2 hosts; torch/gloo on 1 + 1 (its pair groups cross the same links; a smaller cluster keeps the suite
# inside its time budget)
REPLICAS = {"grpc": {"prefill": 2, "decode": 2}, "torch": {"prefill": 1, "decode": 1}}
ADMIN_TOKEN = "test-admin-token"
API_KEY = "sk-test"
PROMPTS = [f"Host test {i}: the capital cities of Europe, from west to east, are" for i in range(4)]
MAX_TOKENS = 8
READY_GATEWAY = r"^splitserve: serving \S+ on (http://\S+) \(gateway"
READY_HEAD = r"^splitserve: head ready: .*\((.*)\)$"


def values(transport: str) -> dict:
    return {
        "numThreads": 1,
        "kvTransport": transport,
        "prefill": {"replicas": REPLICAS[transport]["prefill"]},
        "decode": {"replicas": REPLICAS[transport]["decode"]},
        # every prompt through a prefill worker; round-robin so that every worker of both pools serves
        "gateway": {"replicas": 1, "args": ["--disagg-prefill-threshold=0", "--routing-policy=round-robin"]},
        "engine": ["--kv-cache-memory=128MiB", "--max-model-len=512"],
        "secrets": {"apiKey": API_KEY, "adminToken": ADMIN_TOKEN},
    }


@pytest.fixture(scope="module")
def expected(smollm2_checkpoint) -> dict[str, str]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=512), smollm2_checkpoint)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    answers = {}
    while engine.has_unfinished_requests():
        answers |= {PROMPTS[int(out.request_id)]: out.text for out in engine.step() if out.finished}
    return answers


@pytest.fixture(scope="module", params=["grpc", "torch"])
def cluster(request, smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHostCluster]:
    transport = request.param
    replicas = REPLICAS[transport]
    network = HostNetwork(MultiHostCluster.hosts(replicas), tag=f"h{transport[0]}")
    network.create()
    tmp = tmp_path_factory.mktemp(f"hosts-{transport}")
    hosts = MultiHostCluster(render(values(transport)), release_prefix=f"{RELEASE}-splitserve-", tmp=tmp,
                             network=network, replicas=replicas)
    hosts.transport = transport
    try:
        hosts.start("redis")
        hosts.wait_for_port("redis", "redis", timeout_s=60)
        hosts.start("head")
        hosts.wait_for_port("head", "gcs", timeout_s=180)
        for name in [*(n for n in hosts.pods if n.startswith(("prefill-", "decode-"))), "gateway"]:
            hosts.start(name)
            hosts.wait_for_port(name, "raylet", timeout_s=180)
        hosts.wait_for_line("head", READY_HEAD, timeout_s=400)
        url = hosts.wait_for_line("gateway", READY_GATEWAY, timeout_s=400).group(1)
        hosts.url = url.replace("0.0.0.0", hosts.address(hosts.pods["gateway"]))
        hosts.wait_serving(timeout_s=240)
        yield hosts
    finally:
        for name in hosts.pods:
            hosts.stop(name, timeout_s=30)
        hosts.leftovers(timeout_s=5)
        network.close()


def _get(cluster: MultiHostCluster, path: str, token: str) -> dict:
    request = urllib.request.Request(f"{cluster.url}{path}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def _complete(cluster: MultiHostCluster, prompt: str) -> str:
    body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{cluster.url}/v1/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"]


def test_requests_cross_the_hosts_and_get_the_offline_answers(cluster: MultiHostCluster,
                                                              expected: dict[str, str]) -> None:
    workers = _get(cluster, "/admin/pools", ADMIN_TOKEN)["workers"]
    replicas = REPLICAS[cluster.transport]
    assert sorted(w["role"] for w in workers) == ["decode"] * replicas["decode"] + ["prefill"] * replicas["prefill"]
    for pool in ("prefill", "decode"):  # each on a host of its pool, advertising that host's IP
        nodes = sorted(w["node"] for w in workers if w["role"] == pool)
        assert nodes == sorted(cluster.host_ips(pool)), (pool, workers)
    for prompt in PROMPTS:
        assert _complete(cluster, prompt) == expected[prompt]
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert f'splitserve:requests_by_prefill_path_total{{path="remote"}} {float(len(PROMPTS))}' in metrics
    index = _get(cluster, "/v1/prefix_index", API_KEY)
    assert index["up"], index
    indexed = {w["worker_id"]: w for w in index["workers"] if w["num_blocks"] > 0}
    by_id = {w["worker_id"]: w for w in workers}
    # every worker served (round-robin) and holds blocks of its prompts, under the incarnation the pools list
    assert set(indexed) == set(by_id), index
    assert all(w["live"] and w["incarnation"] == by_id[i]["incarnation"] for i, w in indexed.items()), index
