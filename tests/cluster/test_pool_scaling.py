"""Pools that scale at runtime and heal without losing a stream, against a real `splitserve serve` (real Ray, real
workers on the real model, real gRPC, the embedded Redis prefix index), driven through the admin API. One cluster
for the module, one scenario in order (each step needs the one before it; a cluster start is what costs):

    1+1 ──scale up under load──▶ 2+2 ──SIGKILL a decode worker mid-stream──▶ 2+2 (restarted)
        ──scale down under load──▶ 1+1

- under a steady load of a few streaming clients, every request completes, with no error event;
- the new workers serve (they hold blocks in the prefix index);
- the killed worker's stream completes with the greedy text of an undisturbed run; the controller restarts it;
- the scale-down's workers are listed draining, finish what they hold (no request is migrated), leave no entry
  in the prefix index; the remaining workers' KV blocks are all free at the end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import serving_pb2, serving_pb2_grpc
from protos.cluster_auth import CLUSTER_SECRET_ENV, ClusterAuth, sync_channel
from tests.cluster.load import SteadyLoad, stream_greedy
from tests.deploy.processes import ServeProcess, serve_argv, serving
from worker.runtime import FAULT_STEP_SLEEP_ENV

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TOKEN = "test-admin-token"
CLUSTER = ClusterAuth(secret="test-cluster-secret")  # the test asks the workers for their load itself
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KILL_PROMPT = "The lighthouse keeper climbed the stairs and"
KILL_MAX_TOKENS = 40
KILL_AFTER = 8  # chunks the client has read when its decode worker is killed


def _load_prompt(client: int, n: int) -> str:
    # three full 16-token blocks or more, and no prefix shared between requests
    return f"Client {client}, request {n}: list the planets of the solar system, their moons, and one fact each."


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: str, tmp_path_factory) -> Iterator[tuple[str, ServeProcess]]:
    argv = serve_argv(smollm2_gguf, "--prefill-workers", "1", "--decode-workers", "1", "--admin-token", TOKEN,
                      "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--drain-timeout", "30",
                      "--routing-policy", "least-loaded",  # spread the load over the new workers
                      "--disagg-prefill-threshold", "0",  # every prompt through a prefill worker
                      "--health-check-interval", "0.5", "--health-check-timeout", "2",
                      "--health-check-failure-threshold", "3")
    # Every engine step paced (20 ms) so that a stream is surely still running when its worker is killed.
    with serving(argv, stderr_path=tmp_path_factory.mktemp("scaling") / "stderr.txt",
                 env={FAULT_STEP_SLEEP_ENV: "0.02", CLUSTER_SECRET_ENV: CLUSTER.secret}) as serve:
        yield serve.url, serve


def _pools(url: str) -> list[dict]:
    response = httpx.get(f"{url}/admin/pools", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["workers"]


def _scale(url: str, **sizes: int) -> list[dict]:
    response = httpx.post(f"{url}/admin/scale", headers=AUTH, json=sizes, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["workers"]


def _metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def _migrations(url: str) -> float:
    return sum(_metric(url, "splitserve:request_migrations_total").values())


def _indexed(url: str) -> dict[str, int]:
    """worker id -> blocks the prefix index holds for it."""
    body = httpx.get(f"{url}/v1/prefix_index", timeout=30).json()
    assert body["up"], body
    return {w["worker_id"]: w["num_blocks"] for w in body["workers"]}


def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _running(endpoint: str) -> int:
    with sync_channel(endpoint, CLUSTER) as channel:
        load = serving_pb2_grpc.WorkerStub(channel).GetLoad(serving_pb2.LoadRequest(), timeout=10)
    return load.num_requests_running


def _assert_all_completed(outcomes: list) -> None:
    failed = [o for o in outcomes if not o.completed]
    assert not failed, failed[:3]
    assert outcomes and all(o.status == 200 for o in outcomes)


def test_scale_up_kill_and_scale_down_under_load_lose_no_request(cluster) -> None:
    url, serve = cluster
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    # -- 1+1 -> 2+2 under load: every request completes, the new workers serve ----------------------------------
    load = SteadyLoad(url, model, num_clients=2, max_tokens=8, prompt=_load_prompt).start()
    load.wait_for(2, 120)
    grown = _scale(url, prefill=2, decode=2)
    assert sorted((w["worker_id"], w["state"]) for w in grown) == [
        ("decode-0", "serving"), ("decode-1", "serving"), ("prefill-0", "serving"), ("prefill-1", "serving")]
    _wait(lambda: {"prefill-1", "decode-1"} <= {w for w, n in _indexed(url).items() if n},
          60, "the new workers served nothing")
    _assert_all_completed(load.stop())

    # -- SIGKILL the decode worker under a stream: it goes on elsewhere, the same text; the worker is restarted --
    expected = stream_greedy(url, model, KILL_PROMPT, max_tokens=KILL_MAX_TOKENS)
    assert expected.finish_reasons == ["length"] and len(expected.tokens) == KILL_MAX_TOKENS
    killed: list[dict] = []
    killed_at: list[float] = []

    def kill_the_busy_decode_worker(num_chunks: int) -> None:
        if num_chunks != KILL_AFTER:
            return
        (victim,) = [w for w in _pools(url) if w["role"] == "decode" and _running(w["endpoint"])]
        os.kill(victim["pid"], signal.SIGKILL)
        killed.append(victim)
        killed_at.append(time.monotonic())

    got = stream_greedy(url, model, KILL_PROMPT, max_tokens=KILL_MAX_TOKENS, on_chunk=kill_the_busy_decode_worker)
    assert killed, "the stream ended before its worker was killed"
    assert not got.errors and got.finish_reasons == ["length"]
    assert got.text == expected.text and got.tokens == expected.tokens  # no gap, no duplicate
    assert got.usage["completion_tokens"] == KILL_MAX_TOKENS
    assert _migrations(url) == 1
    (victim,) = killed

    def restarted() -> bool:
        now = {w["worker_id"]: w for w in _pools(url)}.get(victim["worker_id"])
        return bool(now and now["state"] == "serving" and now["incarnation"] != victim["incarnation"]
                    and now["pid"] != victim["pid"] and now["load"] and now["load"]["healthy"])

    _wait(restarted, 90, f"{victim['worker_id']} was not restarted")
    assert time.monotonic() - killed_at[0] < 60  # noticed within the health-check interval x threshold, reloaded
    restarts = {dict(k)["role"]: v for k, v in _metric(url, "splitserve:worker_restarts_total").items()
                if dict(k)["reason"] == "process_died"}
    assert restarts == {"prefill": 0, "decode": 1}
    assert f"restarted (process_died) {victim['worker_id']}" in serve.output(tail_chars=None)  # the log may go on

    # -- 2+2 -> 1+1 under load: the removed workers drain (listed draining, nothing migrated), leave no index entry
    load = SteadyLoad(url, model, num_clients=3, max_tokens=24, prompt=_load_prompt).start()
    load.wait_for(3, 120)
    states: set[tuple[str, str]] = set()
    held_while_draining: dict[str, int] = {}  # the most requests a draining worker was seen running
    scaled = threading.Event()

    def watch_states() -> None:
        while not scaled.is_set():
            for w in _pools(url):
                states.add((w["worker_id"], w["state"]))
                if w["state"] == "draining":
                    try:
                        running = _running(w["endpoint"])
                    except grpc.RpcError:  # stopped meanwhile
                        continue
                    held_while_draining[w["worker_id"]] = max(held_while_draining.get(w["worker_id"], 0), running)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_states)
    watcher.start()
    try:
        shrunk = _scale(url, prefill=1, decode=1)
    except BaseException:
        load.stop()
        raise
    finally:
        scaled.set()
        watcher.join()
    assert ("decode-1", "draining") in states  # (prefill-1 has only quick prefills to finish: too fast to see)
    assert sorted((w["worker_id"], w["state"]) for w in shrunk) == [("decode-0", "serving"), ("prefill-0", "serving")]
    load.wait_for(len(load.outcomes) + 3, 120)  # the cluster serves on with what is left
    _assert_all_completed(load.stop())
    assert held_while_draining.get("decode-1"), held_while_draining  # decode-1 had requests to finish ...
    assert _migrations(url) == 1  # ... and finished them: nothing was migrated
    assert not {"prefill-1", "decode-1"} & set(_indexed(url))

    def all_blocks_free() -> bool:
        loads = [w["load"] for w in _pools(url)]
        return all(load is not None and load["kv_blocks_used"] == 0 for load in loads)

    _wait(all_blocks_free, 15, f"KV blocks still in use: {_pools(url)}")
