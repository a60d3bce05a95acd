"""The cluster on several hosts: the Helm chart's pods (tests/multihost/cluster.py) on network namespaces, each its
own IP on one bridge — the head host (the Ray head and controller, the gateway), a Redis host, prefill hosts and
decode hosts whose Ray nodes join with their pool's resource, as the README describes.

Over each transport that crosses hosts (grpc, torch/gloo), requests through the gateway from outside (the test,
on the bridge) get the offline engine's greedy answers; every worker runs on a host of its pool and advertises
that host's IP (`/admin/pools`), the prefix index holds the blocks of workers on those hosts, and KV crossed from
prefill hosts to decode hosts.

Partitions (grpc, 2 + 2 hosts; a host's link to the bridge cut, then healed; docs/multihost.md says what Ray does):
- a decode host cut mid-stream: the gateway's keepalive fails the stream within seconds and it resumes on the other
  decode host, with the undisturbed greedy text; healed, the host's worker serves again (its old incarnation's
  index entries gone) and no worker holds a block;
- a prefill host cut mid-handoff: the decode worker's Prefill call fails within the KV transfer timeout, the
  gateway retries on the other prefill host, the answer is the undisturbed one; healed, nothing leaks anywhere;
- the Redis host cut: requests are routed by load and answered; healed, the index holds every live worker again.

Where namespaces cannot be made (no root, no iproute2), the module is skipped with the reason; the project's CI
runs as root, where they can.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx

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
    # While this file exists, a prefill worker's handoff of 2+ blocks stalls half-way (prefill_worker/worker.py);
    # the head's controller hands the setting on to every worker.
    stall_file = tmp / "stall"
    hosts = MultiHostCluster(render(values(transport)), release_prefix=f"{RELEASE}-splitserve-", tmp=tmp,
                             network=network, replicas=replicas,
                             extra_env={"head": {"SPLITSERVE_FAULT_KV_STALL_FILE": str(stall_file)}})
    hosts.stall_file = stall_file
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
        # As tests/helm/test_pods_as_processes.py stops its pods: the gateway, then the pools and the head at once
        # (a pool node drains for up to 30 s on SIGTERM: in parallel, not one after another), Redis last.
        hosts.stop_all(["gateway"])
        hosts.stop_all([name for name in hosts.pods if name not in ("gateway", "redis")])
        hosts.stop_all(["redis"])
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



# -- partitions -------------------------------------------------------------------------------------------------------
LONG_PROMPT = "Partition test: write a long story about a lighthouse keeper, the sea, and the ships that pass"
LONG_TOKENS = 160
HANDOFF_PROMPT = ("Partition test, a prompt of several blocks so that its handoff can stall half-way: " +
                  "the quick brown fox jumps over the lazy dog. " * 4)


@pytest.fixture(scope="module")
def long_answers(smollm2_checkpoint) -> dict[str, str]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=512), smollm2_checkpoint)
    prompts = {LONG_PROMPT: LONG_TOKENS, HANDOFF_PROMPT: MAX_TOKENS}
    for i, (prompt, num) in enumerate(prompts.items()):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=num, ignore_eos=True))
    answers = {}
    while engine.has_unfinished_requests():
        answers |= {list(prompts)[int(out.request_id)]: out.text for out in engine.step() if out.finished}
    return answers


def _load(cluster: MultiHostCluster, worker: dict):  # noqa: ANN202
    from protos import serving_pb2, serving_pb2_grpc
    from protos.cluster_auth import ClusterAuth, sync_channel

    channel = sync_channel(worker["endpoint"], ClusterAuth(secret=cluster.secret["cluster-secret"]))
    try:
        return serving_pb2_grpc.WorkerStub(channel).GetLoad(serving_pb2.LoadRequest(), timeout=10)
    finally:
        channel.close()


def _host_of(cluster: MultiHostCluster, worker: dict) -> str:
    return next(h for h in cluster.network.hosts if cluster.network.ip(h) == worker["node"])


def _metric(cluster: MultiHostCluster, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _settle(cluster: MultiHostCluster, timeout_s: float = 300) -> list[dict]:
    """Until every pool is back to its size, every worker serving and answering, and none holds a KV block (the pods
    restarted as the kubelet would meanwhile); the workers."""
    want = REPLICAS[cluster.transport]
    deadline = time.monotonic() + timeout_s
    while True:
        cluster.supervise()
        try:
            workers = _get(cluster, "/admin/pools", ADMIN_TOKEN)["workers"]
            if (sorted(w["role"] for w in workers) == ["decode"] * want["decode"] + ["prefill"] * want["prefill"]
                    and all(w["state"] == "serving" for w in workers)
                    and all(_load(cluster, w).kv_blocks_used == 0 for w in workers)):
                return workers
        except Exception as exc:  # noqa: BLE001 - a worker still away
            last = exc
        else:
            last = workers
        assert time.monotonic() < deadline, f"the cluster did not settle: {last}\n{cluster.describe()}"
        time.sleep(1.0)


class _Stream(threading.Thread):
    """One streaming completion read to its end on a thread: its text, when its first chunk came, when it ended."""

    def __init__(self, cluster: MultiHostCluster, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = cluster.url, prompt, max_tokens
        self.text, self.error = "", None
        self.chunk_times: list[float] = []
        self.first = threading.Event()
        self.ended_s = 0.0

    def run(self) -> None:
        body = {"model": "smollm2-135m", "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = chunk["error"]
                        else:
                            self.text += chunk["choices"][0]["text"]
                            self.chunk_times.append(time.monotonic())
                            self.first.set()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = repr(exc)
        self.ended_s = time.monotonic()
        self.first.set()


@pytest.mark.parametrize("cluster", ["grpc"], indirect=True)
def test_a_decode_host_cut_mid_stream_resumes_elsewhere_and_rejoins_when_healed(
        cluster: MultiHostCluster, long_answers: dict[str, str], expected: dict[str, str]) -> None:
    before = {w["worker_id"]: w for w in _settle(cluster)}
    migrations = _metric(cluster, "splitserve:request_migrations_total")
    stream = _Stream(cluster, LONG_PROMPT, LONG_TOKENS)
    stream.start()
    assert stream.first.wait(120) and stream.error is None, stream.error
    victim = next(w for w in before.values() if w["role"] == "decode" and _load(cluster, w).num_requests_running)
    host = _host_of(cluster, victim)
    cut_s = time.monotonic()
    cluster.network.cut(host)
    try:
        stream.join(180)
        assert not stream.is_alive(), "the stream hung on the cut host"
        assert stream.error is None, stream.error
        assert stream.text == long_answers[LONG_PROMPT]
        # Resumed within the keepalive's bound (protos/cluster_auth.py: 10 s pings, 10 s to answer them) and the
        # new prefill; without it the stream would wait until the controller gives the worker up (~28 s) and the
        # gateway's channel to it closes (its 30 s grace): about a minute.
        resumed_s = next(t for t in stream.chunk_times if t > cut_s + 1.0) - cut_s
        print(f"stream resumed {resumed_s:.1f} s after its decode host was cut")
        assert resumed_s < 40
        assert _metric(cluster, "splitserve:request_migrations_total") >= migrations + 1
        # The cut held until the controller gives the worker up (its Health unanswered 3 times in a row) and
        # restarts it: there is no room for it on the other decode host, so it waits for one.
        deadline = time.monotonic() + 120
        while (now := {w["worker_id"]: w for w in _get(cluster, "/admin/pools", ADMIN_TOKEN)["workers"]}).get(
                victim["worker_id"], {}).get("incarnation") == victim["incarnation"]:
            assert time.monotonic() < deadline, f"the controller did not give the cut worker up: {now}"
            time.sleep(1.0)
        given_up_s = time.monotonic() - cut_s
    finally:
        cluster.network.heal(host)
    pod = cluster.pods[host]
    restarts_before = pod.num_restarts
    after = {w["worker_id"]: w for w in _settle(cluster)}
    rejoined = after[victim["worker_id"]]
    assert rejoined["incarnation"] != victim["incarnation"] and rejoined["node"] == victim["node"]
    print(f"decode host cut {given_up_s:.0f} s until the controller restarted {victim['worker_id']}; back as "
          f"incarnation {rejoined['incarnation']} on {rejoined['node']}; its Ray node's pod restarted "
          f"{pod.num_restarts - restarts_before} times")
    index = _get(cluster, "/v1/prefix_index", API_KEY)
    stale = [w for w in index["workers"] if w["worker_id"] == victim["worker_id"]
             and w["incarnation"] != rejoined["incarnation"]]
    assert not stale, f"the cut worker's old incarnation is still indexed: {index}"
    for prompt in PROMPTS[:2]:  # serving again, every host
        assert _complete(cluster, prompt) == expected[prompt]


@pytest.mark.parametrize("cluster", ["grpc"], indirect=True)
def test_a_prefill_host_cut_mid_handoff_is_retried_on_the_other_and_nothing_leaks(
        cluster: MultiHostCluster, long_answers: dict[str, str]) -> None:
    workers = {w["worker_id"]: w for w in _settle(cluster)}
    retries = _metric(cluster, "splitserve:request_retries_total")
    stall: Path = cluster.stall_file
    stall.write_text("")
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(_complete(cluster, HANDOFF_PROMPT)), daemon=True)
    thread.start()
    host = None
    try:
        deadline = time.monotonic() + 120
        while "stalled" not in stall.read_text():
            assert time.monotonic() < deadline, "no handoff stalled"
            time.sleep(0.2)
        victim = next(w for w in workers.values() if w["role"] == "prefill" and _load(cluster, w).kv_blocks_used)
        host = _host_of(cluster, victim)
        cut_s = time.monotonic()
        cluster.network.cut(host)
        stall.unlink()  # the other prefill worker's handoff must not stall
        thread.join(120)
        assert not thread.is_alive(), "the request hung on the cut prefill host"
        assert answer == [long_answers[HANDOFF_PROMPT]]
        assert time.monotonic() - cut_s < 30 + 15  # --kv-transfer-timeout (30 s), and the retry's own prefill
        assert _metric(cluster, "splitserve:request_retries_total") >= retries + 1
    finally:
        stall.unlink(missing_ok=True)
        if host is not None:
            cluster.network.heal(host)
    _settle(cluster)  # every worker back, none holding a block


@pytest.mark.parametrize("cluster", ["grpc"], indirect=True)
def test_the_redis_host_cut_routes_by_load_and_the_index_comes_back(cluster: MultiHostCluster,
                                                                     expected: dict[str, str]) -> None:
    _settle(cluster)
    cluster.network.cut("redis")
    try:
        for prompt in PROMPTS[2:]:
            assert _complete(cluster, prompt) == expected[prompt]
        response = httpx.get(f"{cluster.url}/v1/prefix_index", timeout=60,
                             headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 503 and not response.json()["up"], response.text
    finally:
        cluster.network.heal("redis")
    workers = {w["worker_id"]: w for w in _settle(cluster)}
    deadline = time.monotonic() + 120
    while True:  # the workers republish what they hold once Redis answers again
        for prompt in PROMPTS:
            _complete(cluster, prompt)
        index = _get(cluster, "/v1/prefix_index", API_KEY)
        live = {w["worker_id"] for w in index["workers"] if w["live"] and w["num_blocks"] > 0}
        if index["up"] and live == set(workers):
            break
        assert time.monotonic() < deadline, f"the index did not come back: {index}"
        time.sleep(2)
