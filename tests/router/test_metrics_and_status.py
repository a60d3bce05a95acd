"""/metrics, /v1/models and /health; colocated mode."""

from __future__ import annotations

import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import MAX_MODEL_LEN, MODEL, Cluster, info_of, serve_router
from tests.router.fake_worker import FakeWorker, Script

WORKER_GAUGES = ["num_requests_running", "num_requests_waiting", "num_requests_receiving_kv", "kv_cache_usage_perc",
                 "kv_blocks_used", "kv_blocks_total", "worker_healthy"]
WORKER_COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "kv_transfer_bytes", "num_preemptions",
                   "kv_transfers", "kv_transfer_failures"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "kv_transfer_seconds", "ttft_stage_seconds"]
COUNTERS = ["request_success", "request_failure", "prompt_tokens", "generation_tokens"]


def scrape(client: httpx.Client) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    """sample name -> [(labels, value, family type)]"""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value, family.type))
    return samples


def value(samples, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    matches = [v for sample_labels, v, _ in samples[name] if labels.items() <= sample_labels.items()]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_metrics_after_a_request(cluster: Cluster) -> None:
    before = scrape(cluster.client)
    cluster.decode.load.num_requests_running = 3
    cluster.decode.load.num_requests_waiting = 2
    cluster.decode.load.num_requests_receiving_kv = 4
    cluster.decode.load.kv_blocks_used = 25
    cluster.decode.load.kv_cache_usage = 0.25
    cluster.prefill.load.prefix_cache_queries = 100
    cluster.prefill.load.prefix_cache_hits = 64
    cluster.prefill.load.kv_transfer_bytes = 4096
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4})
    assert response.status_code == 200

    samples = scrape(cluster.client)  # the scrape polls the workers first: these are the loads set above
    for name in WORKER_GAUGES:
        assert {labels["worker"] for labels, _, kind in samples[f"splitserve:{name}"]} == {"prefill-0", "decode-0"}
        assert samples[f"splitserve:{name}"][0][2] == "gauge"
    for name in WORKER_COUNTERS:
        workers = {labels["worker"] for labels, _, kind in samples[f"splitserve:{name}_total"]}
        assert workers == {"prefill-0", "decode-0"}, name
    assert value(samples, "splitserve:num_requests_running", worker="decode-0") == 3
    assert value(samples, "splitserve:num_requests_waiting", worker="decode-0") == 2
    assert value(samples, "splitserve:num_requests_receiving_kv", worker="decode-0") == 4
    assert value(samples, "splitserve:kv_blocks_used", worker="decode-0") == 25
    assert value(samples, "splitserve:kv_cache_usage_perc", worker="decode-0") == 0.25
    assert value(samples, "splitserve:prefix_cache_queries_total", worker="prefill-0") == 100
    assert value(samples, "splitserve:prefix_cache_hits_total", worker="prefill-0") == 64
    assert value(samples, "splitserve:kv_transfer_bytes_total", worker="prefill-0") == 4096
    assert value(samples, "splitserve:worker_healthy", worker="decode-0") == 1

    def delta(name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    for name in HISTOGRAMS[:3]:
        assert delta(f"splitserve:{name}_count") >= (3 if name.startswith("inter") else 1), name
    for stage in ("router_queue", "decode_queue", "prefill_queue", "prefill", "kv_transfer"):
        assert delta("splitserve:ttft_stage_seconds_count", stage=stage) == 1, stage
    assert delta("splitserve:ttft_stage_seconds_sum", stage="kv_transfer") == pytest.approx(0.004)
    assert delta("splitserve:kv_transfer_seconds_count") == 1
    assert delta("splitserve:request_success_total", finished_reason="length") == 1
    assert delta("splitserve:prompt_tokens_total") == 3
    assert delta("splitserve:generation_tokens_total") == 4


def test_cpu_kernels_info_names_each_workers_kernel_builds(cluster: Cluster) -> None:
    from protos import serving_pb2

    cluster.prefill.load.cpu_kernels.extend([serving_pb2.CpuKernel(kernel="cpu_elementwise", variant="x86-64-v4"),
                                             serving_pb2.CpuKernel(kernel="block_copy", variant="x86-64-v4")])
    cluster.decode.load.cpu_kernels.extend([serving_pb2.CpuKernel(kernel="cpu_elementwise", variant="torch")])
    samples = scrape(cluster.client)
    info = {(labels["worker"], labels["kernel"], labels["variant"], value, kind)
            for labels, value, kind in samples["splitserve:cpu_kernels_info"]}
    assert info == {("prefill-0", "cpu_elementwise", "x86-64-v4", 1.0, "gauge"),
                    ("prefill-0", "block_copy", "x86-64-v4", 1.0, "gauge"),
                    ("decode-0", "cpu_elementwise", "torch", 1.0, "gauge")}


def test_failures_and_aborts_are_counted(cluster: Cluster) -> None:
    before = scrape(cluster.client)
    cluster.decode.script = Script(error_after=1)
    assert cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 500
    samples = scrape(cluster.client)
    worker_errors = [v for labels, v, _ in samples["splitserve:request_failure_total"]
                     if labels["reason"] == "worker_error"]
    earlier = [v for labels, v, _ in before.get("splitserve:request_failure_total", [])
               if labels["reason"] == "worker_error"]
    assert worker_errors[0] - (earlier[0] if earlier else 0) == 1


def test_a_failing_worker_shows_unhealthy(cluster: Cluster) -> None:
    import grpc

    cluster.prefill.load_status = grpc.StatusCode.UNAVAILABLE
    samples = scrape(cluster.client)
    assert value(samples, "splitserve:worker_healthy", worker="prefill-0") == 0
    assert cluster.client.get("/health").status_code == 503
    cluster.prefill.load_status = None
    scrape(cluster.client)
    assert cluster.client.get("/health").status_code == 200


def test_models(cluster: Cluster) -> None:
    body = cluster.client.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == MODEL and model["object"] == "model" and model["owned_by"] == "splitserve"
    assert isinstance(model["created"], int) and model["max_model_len"] == MAX_MODEL_LEN
    assert cluster.client.get(f"/v1/models/{MODEL}").json() == model  # OpenAI's retrieve
    missing = cluster.client.get("/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_health(cluster: Cluster) -> None:
    response = cluster.client.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["mode"] == "disaggregated"
    assert {w["worker_id"]: w["healthy"] for w in body["workers"]} == {"prefill-0": True, "decode-0": True}


def test_colocated_mode(fakes: dict[str, FakeWorker], tokenizer) -> None:
    for fake in fakes.values():
        fake.reset()
    colocated = fakes["colocated-0"]
    # Disaggregated workers in the list are ignored in colocated mode, and vice versa.
    server = serve_router([info_of(colocated), info_of(fakes["decode-0"])], tokenizer, mode="colocated")
    try:
        with httpx.Client(base_url=server.url) as client:
            assert client.get("/health").json()["mode"] == "colocated"
            body = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).json()
            assert body["choices"][0]["text"] == "He"
            (request,) = colocated.requests
            assert request.prefill_endpoint == "" and fakes["decode-0"].requests == []
            samples = scrape(client)
            # No KV moved: the kv_transfer stage stays empty while the others count the request.
            assert value(samples, "splitserve:ttft_stage_seconds_count", stage="prefill") == 1
            assert value(samples, "splitserve:ttft_stage_seconds_count", stage="kv_transfer") == 0
    finally:
        server.stop()
    disaggregated = serve_router([info_of(colocated)], tokenizer)
    try:
        with httpx.Client(base_url=disaggregated.url) as client:
            assert client.get("/health").status_code == 503
    finally:
        disaggregated.stop()


def test_metric_names_are_prefixed(cluster: Cluster) -> None:
    text = cluster.client.get("/metrics").text
    names = set(re.findall(r"^# TYPE (\S+)", text, flags=re.MULTILINE))
    assert names and all(name.startswith("splitserve:") for name in names)


def test_spec_decode_metrics_come_from_the_decode_workers_load(cluster: Cluster) -> None:
    load = cluster.decode.load
    load.spec_decode_num_drafts = 10
    load.spec_decode_num_draft_tokens = 40
    load.spec_decode_num_accepted_tokens = 25
    load.spec_decode_num_accepted_tokens_per_pos.extend([9, 8, 5, 3])
    load.spec_decode_chosen_k.extend([6, 1, 0, 2, 7])  # k = 0..4
    samples = scrape(cluster.client)
    assert value(samples, "splitserve:spec_decode_num_drafts_total", worker="decode-0") == 10
    assert value(samples, "splitserve:spec_decode_num_draft_tokens_total", worker="decode-0") == 40
    assert value(samples, "splitserve:spec_decode_num_accepted_tokens_total", worker="decode-0") == 25
    assert value(samples, "splitserve:spec_decode_num_accepted_tokens_total", worker="prefill-0") == 0
    per_pos = {labels["position"]: v
               for labels, v, _ in samples["splitserve:spec_decode_num_accepted_tokens_per_pos_total"]
               if labels["worker"] == "decode-0"}
    assert per_pos == {"0": 9, "1": 8, "2": 5, "3": 3}
    buckets = {labels["le"]: v for labels, v, _ in samples["splitserve:spec_decode_chosen_k_bucket"]}
    assert buckets == {"0.0": 6, "1.0": 7, "2.0": 7, "3.0": 9, "4.0": 16, "+Inf": 16}
    assert value(samples, "splitserve:spec_decode_chosen_k_sum", worker="decode-0") == 1 + 6 + 28
    assert value(samples, "splitserve:spec_decode_chosen_k_count", worker="decode-0") == 16


def test_pool_signals_for_autoscalers(cluster: Cluster) -> None:
    """splitserve:pool_*: each pool's loads summed (or averaged) over its workers, and the latency percentiles of
    the requests in the window, TTFT on the prefill pool and TPOT on the decode pool."""
    cluster.prefill.load.num_requests_waiting = 3
    cluster.prefill.load.num_queued_prompt_tokens = 120
    cluster.decode.load.num_requests_running = 2
    cluster.decode.load.kv_cache_usage = 0.4
    response = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4})
    assert response.status_code == 200
    samples = scrape(cluster.client)
    assert value(samples, "splitserve:pool_num_workers", pool="prefill") == 1
    assert value(samples, "splitserve:pool_num_workers", pool="decode") == 1
    assert value(samples, "splitserve:pool_num_requests_waiting", pool="prefill") == 3
    assert value(samples, "splitserve:pool_num_queued_prompt_tokens", pool="prefill") == 120
    assert value(samples, "splitserve:pool_num_requests_running", pool="decode") == 2
    assert value(samples, "splitserve:pool_kv_cache_usage_perc", pool="decode", stat="mean") == 0.4
    assert value(samples, "splitserve:pool_kv_cache_usage_perc", pool="decode", stat="max") == 0.4
    assert value(samples, "splitserve:pool_latency_window_samples", pool="prefill", metric="ttft") >= 1
    assert value(samples, "splitserve:pool_latency_window_samples", pool="decode", metric="tpot") >= 1
    ttft = {labels["quantile"]: v for labels, v, _ in samples["splitserve:pool_time_to_first_token_seconds"]}
    tpot = {labels["quantile"]: v for labels, v, _ in samples["splitserve:pool_time_per_output_token_seconds"]}
    assert set(ttft) == set(tpot) == {"0.5", "0.9", "0.99"}
    assert 0 < ttft["0.5"] <= ttft["0.9"] <= ttft["0.99"] < 30
    assert 0 <= tpot["0.5"] <= tpot["0.9"] <= tpot["0.99"] < 30
    assert {labels["pool"] for labels, _, _ in samples["splitserve:pool_time_to_first_token_seconds"]} == {"prefill"}
    assert "splitserve:autoscaler_decisions_total" not in samples  # no autoscaler here: no series


def test_worker_quantization_info_names_each_workers_quantization(cluster: Cluster) -> None:
    cluster.prefill.load.quantization = "gguf"
    cluster.decode.load.quantization = "int8"
    samples = scrape(cluster.client)
    info = {(labels["worker"], labels["quantization"], value)
            for labels, value, _ in samples["splitserve:worker_quantization_info"]}
    assert info == {("prefill-0", "gguf", 1.0), ("decode-0", "int8", 1.0)}


def test_worker_rank_gauges_label_each_tensor_parallel_rank(cluster: Cluster) -> None:
    from protos import serving_pb2

    cluster.decode.load.ranks.extend(serving_pb2.RankStats(rank=r, pid=100 + r, weight_bytes=1000 + r,
                                                           kv_cache_bytes=50, kv_lane_bytes_received=7 * r)
                                     for r in range(3))
    try:
        samples = scrape(cluster.client)
        weights = {(labels["worker"], labels["rank"], v) for labels, v, _ in samples["splitserve:worker_rank_weight_bytes"]}
        kv = {(labels["worker"], labels["rank"], v) for labels, v, _ in samples["splitserve:worker_rank_kv_cache_bytes"]}
        assert weights == {("decode-0", "0", 1000.0), ("decode-0", "1", 1001.0), ("decode-0", "2", 1002.0)}
        assert kv == {("decode-0", str(r), 50.0) for r in range(3)}
        lanes = {(labels["worker"], labels["rank"], labels["direction"], v)
                 for labels, v, _ in samples["splitserve:kv_lane_bytes_total"]}
        assert lanes == {("decode-0", str(r), d, 7.0 * r if d == "received" else 0.0)
                         for r in range(3) for d in ("sent", "received")}
    finally:
        del cluster.decode.load.ranks[:]
