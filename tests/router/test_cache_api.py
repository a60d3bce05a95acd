"""POST /reset_prefix_cache at the gateway (router/cache_api.py), over fake workers: every healthy worker is asked;
200 when each reset, 409 naming a worker that holds blocks or failed, 503 without a healthy worker, and keyed like
/v1/* when API keys are set. (tests/cluster/test_prefix_index.py resets real workers and their index entries.)"""

from __future__ import annotations

import grpc
import httpx

from engine.tokenizer.tokenizer import Tokenizer
from protos import serving_pb2
from protos.worker_info import WorkerInfo
from router.api_keys import AccessControl, ApiKeyRing
from tests.router.conftest import Cluster, dead_endpoint, serve_router
from tests.router.fake_worker import FakeWorker


def test_every_worker_resets_or_the_answer_names_those_that_did_not(cluster: Cluster) -> None:
    reset = cluster.client.post("/reset_prefix_cache")
    assert reset.status_code == 200
    assert reset.json() == {"reset": True, "workers": [
        {"worker_id": "prefill-0", "reset": True, "kv_blocks_used": 0},
        {"worker_id": "decode-0", "reset": True, "kv_blocks_used": 0}]}
    cluster.decode.reset_reply = serving_pb2.ResetPrefixCacheResponse(reset=False, kv_blocks_used=7)
    cluster.prefill.reset_status = grpc.StatusCode.INTERNAL
    refused = cluster.client.post("/reset_prefix_cache")
    assert refused.status_code == 409 and refused.json()["reset"] is False
    workers = {w["worker_id"]: w for w in refused.json()["workers"]}
    assert workers["decode-0"] == {"worker_id": "decode-0", "reset": False, "kv_blocks_used": 7}
    assert workers["prefill-0"]["reset"] is False and workers["prefill-0"]["error"].startswith("INTERNAL")


def test_without_a_healthy_worker_503_and_with_keys_401(fakes: dict[str, FakeWorker], tokenizer: Tokenizer) -> None:
    nobody = serve_router([WorkerInfo(worker_id="gone", role="decode", endpoint=dead_endpoint())], tokenizer)
    try:
        with httpx.Client(base_url=nobody.url, timeout=30.0) as http:
            assert http.post("/reset_prefix_cache").status_code == 503
    finally:
        nobody.stop()
    fakes["decode-0"].reset()
    keyed = serve_router([WorkerInfo(worker_id="decode-0", role="decode", endpoint=fakes["decode-0"].endpoint)],
                         tokenizer, access=AccessControl(ring=ApiKeyRing(["sk-reset"])))
    try:
        with httpx.Client(base_url=keyed.url, timeout=30.0) as http:
            assert http.post("/reset_prefix_cache").status_code == 401
            assert http.post("/reset_prefix_cache", headers={"Authorization": "Bearer sk-reset"}).status_code == 200
    finally:
        keyed.stop()
