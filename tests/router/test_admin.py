"""The admin API (router/admin.py) and `splitserve scale`, over a stand-in controller and fake workers."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from deploy import cli
from router.admin import PoolWorker, scale_targets
from router.app import create_app
from router.config import RouterConfig
from router.errors import ApiError
from router.server import RouterServer
from router.worker_registry import WorkerRegistry
from tests.router.conftest import MAX_MODEL_LEN, MODEL, info_of
from tests.router.fake_worker import FakeWorker

TOKEN = "s3cret-admin-token"


class StandInController:
    """A PoolController whose pools are lists of PoolWorker; `scale` resizes them, newest removed first."""

    def __init__(self, workers: list[PoolWorker]) -> None:
        self.workers = list(workers)
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def scale(self, role: str, num_workers: int) -> None:
        with self._lock:
            self.calls.append((role, num_workers))
            pool = [w for w in self.workers if w.role == role]
            others = [w for w in self.workers if w.role != role]
            for i in range(len(pool), num_workers):
                pool.append(PoolWorker(worker_id=f"{role}-new{i}", role=role, state="serving",
                                       endpoint=f"127.0.0.1:{9000 + i}", pid=100 + i, incarnation=7))
            self.workers = others + pool[:num_workers]

    def pool_workers(self) -> list[PoolWorker]:
        with self._lock:
            return list(self.workers)


@pytest.fixture
def gateway(fakes: dict[str, FakeWorker], tokenizer) -> Iterator[tuple[str, StandInController]]:  # type: ignore[no-untyped-def]
    from router.admin import AdminApi

    for worker in fakes.values():
        worker.reset()
    infos = [info_of(fakes["prefill-0"]), info_of(fakes["decode-0"])]
    controller = StandInController([PoolWorker(worker_id=i.worker_id, role=i.role, state="serving",
                                               endpoint=i.endpoint, pid=42, incarnation=1,
                                               rank_pids=(43, 44) if i.role == "decode" else ()) for i in infos])
    config = RouterConfig(served_model_names=(MODEL,), max_model_len=MAX_MODEL_LEN,
                          disagg_prefill_threshold_tokens=0)  # every prompt through a prefill worker
    registry = WorkerRegistry(lambda: infos, refresh_interval_s=0.5, load_timeout_s=1.0)
    server = RouterServer(create_app(config, registry, tokenizer,
                                     admin=AdminApi(token=TOKEN, controller=controller))).start()
    yield server.url, controller
    server.stop()


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_without_a_token_configured_the_admin_api_does_not_exist(session_cluster) -> None:  # type: ignore[no-untyped-def]
    client = session_cluster.client
    assert client.get("/admin/pools", headers=_auth()).status_code == 404
    assert client.post("/admin/scale", json={"decode": 2}, headers=_auth()).status_code == 404


@pytest.mark.parametrize("headers", [{}, _auth("wrong"), {"Authorization": TOKEN}, _auth(TOKEN + "x")])
def test_a_missing_or_wrong_token_is_401(gateway, headers: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    url, controller = gateway
    for response in (httpx.get(f"{url}/admin/pools", headers=headers),
                     httpx.post(f"{url}/admin/scale", json={"decode": 2}, headers=headers)):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
        assert TOKEN not in response.text
    assert controller.calls == []


@pytest.mark.parametrize("body", [{}, [], {"decode": 0}, {"decode": -1}, {"decode": 1.5}, {"decode": "2"},
                                  {"decode": True}, {"decode": 257}, {"colocated": 2}, {"gpus": 1}])
def test_bad_counts_are_400(gateway, body: object) -> None:  # type: ignore[no-untyped-def]
    url, controller = gateway
    response = httpx.post(f"{url}/admin/scale", json=body, headers=_auth())
    assert response.status_code == 400, response.text
    assert controller.calls == []


def test_scale_targets_keep_pool_order_and_name_only_the_pools_given() -> None:
    assert scale_targets({"decode": 3, "prefill": 2}, ("prefill", "decode")) == {"prefill": 2, "decode": 3}
    assert scale_targets({"decode": 1}, ("prefill", "decode")) == {"decode": 1}
    with pytest.raises(ApiError, match="unknown pool"):
        scale_targets({"prefill": 1}, ("colocated",))


def test_scale_resizes_each_named_pool_and_pools_lists_every_worker_with_its_load(gateway) -> None:  # type: ignore[no-untyped-def]
    url, controller = gateway
    pools = httpx.get(f"{url}/admin/pools", headers=_auth()).json()["workers"]
    assert [(w["worker_id"], w["role"], w["state"], w["pid"], w["incarnation"], w["node"]) for w in pools] == [
        ("prefill-0", "prefill", "serving", 42, 1, "127.0.0.1"), ("decode-0", "decode", "serving", 42, 1, "127.0.0.1")]
    assert [w["rank_pids"] for w in pools] == [[42], [42, 43, 44]]  # a TP 3 decode worker: every rank's process
    assert all(w["load"]["kv_blocks_total"] == 100 and w["load"]["healthy"] for w in pools)
    response = httpx.post(f"{url}/admin/scale", json={"decode": 2, "prefill": 1}, headers=_auth(), timeout=30)
    assert response.status_code == 200, response.text
    assert controller.calls == [("prefill", 1), ("decode", 2)]
    workers = response.json()["workers"]
    assert [w["worker_id"] for w in workers] == ["prefill-0", "decode-0", "decode-new1"]
    assert workers[-1]["load"] is None  # not polled by the router (the stand-in's endpoint is not a worker)


def test_splitserve_scale_calls_the_admin_api(gateway, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    url, controller = gateway
    monkeypatch.delenv("SPLITSERVE_ADMIN_TOKEN", raising=False)
    assert cli.main(["scale", "--url", url, "--decode", "3", "--admin-token", TOKEN]) == 0
    assert controller.calls == [("decode", 3)]
    out = capsys.readouterr().out
    assert "decode-new2" in out and "serving" in out
    monkeypatch.setenv("SPLITSERVE_ADMIN_TOKEN", "wrong")
    assert cli.main(["scale", "--url", url, "--decode", "1"]) == 1
    assert "401" in capsys.readouterr().err and controller.calls == [("decode", 3)]
    assert cli.main(["scale", "--url", url]) == 2  # no pool named
