"""LoRA adapters at the gateway (router/lora_api.py), over fake workers: a request's `model` names the base model or
an adapter the workers report; it goes only to workers serving that adapter, with the adapter's name on the wire;
/v1/models lists the adapters; run-time loading reaches every worker, all or none, only when the environment
allows it. (tests/cluster/test_serve_openai.py runs real workers.)"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from protos import serving_pb2
from router.lora_api import RUNTIME_LORA_ENV
from tests.router.conftest import MODEL, info_of, serve_router
from tests.router.fake_worker import FakeWorker


def serve(fakes: dict[str, FakeWorker], tokenizer, names: tuple[str, ...]) -> Iterator[httpx.Client]:  # noqa: ANN001
    server = serve_router([info_of(fakes[n]) for n in names], tokenizer)
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            client.get("/metrics").raise_for_status()  # the router polls every worker's load now
            yield client
    finally:
        server.stop()


@pytest.fixture
def workers(fakes: dict[str, FakeWorker]) -> dict[str, FakeWorker]:
    for worker in fakes.values():
        worker.reset()
    sql = serving_pb2.LoRAAdapter(name="sql", digest="sha256:5", path="/adapters/sql")
    for name in ("prefill-0", "decode-1"):
        fakes[name].load.lora_adapters.append(sql)
    return fakes


@pytest.fixture
def client(workers: dict[str, FakeWorker], tokenizer) -> Iterator[httpx.Client]:  # noqa: ANN001
    yield from serve(workers, tokenizer, ("prefill-0", "decode-0", "decode-1"))


def complete(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3})


def test_a_request_under_an_adapter_goes_only_to_workers_serving_it(client, workers) -> None:  # noqa: ANN001
    for _ in range(4):
        answer = complete(client, "sql")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "sql"
    assert [r.lora_name for r in workers["decode-1"].requests] == ["sql"] * 4
    assert not workers["decode-0"].requests
    for _ in range(4):
        assert complete(client, MODEL).status_code == 200
    base = [r for w in ("decode-0", "decode-1") for r in workers[w].requests if not r.lora_name]
    assert len(base) == 4  # the base model's requests go anywhere, with no adapter named
    chat = client.post("/v1/chat/completions", json={"model": "sql", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and workers["decode-1"].requests[-1].lora_name == "sql"


def test_an_unknown_model_is_a_404_naming_the_adapters_too(client) -> None:  # noqa: ANN001
    answer = complete(client, "nope")
    assert answer.status_code == 404
    assert answer.json()["error"]["message"] == f"the model 'nope' does not exist; this server serves {MODEL}, sql"
    assert client.post("/tokenize", json={"model": "sql", "prompt": "hi"}).status_code == 200
    assert client.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404


def test_models_lists_the_adapters_after_the_base_model(client) -> None:  # noqa: ANN001
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [(MODEL, MODEL, None),
                                                                   ("sql", "/adapters/sql", MODEL)]
    assert client.get("/v1/models/sql").json()["parent"] == MODEL
    assert client.get("/v1/models/nope").status_code == 404


def test_without_a_prefill_worker_serving_the_adapter_503(workers, tokenizer) -> None:  # noqa: ANN001
    prefill = workers["prefill-0"].load.lora_adapters
    for held in ([], [serving_pb2.LoRAAdapter(name="sql", digest="sha256:other")]):  # none, or another "sql"
        del prefill[:]
        prefill.extend(held)
        for client in serve(workers, tokenizer, ("prefill-0", "decode-0", "decode-1")):
            answer = complete(client, "sql")
            assert answer.status_code == 503 and "no worker can take the request" in answer.text
    assert not workers["decode-1"].requests


def test_runtime_loading_needs_the_environment(client) -> None:  # noqa: ANN001
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404


@pytest.fixture
def runtime_client(workers, tokenizer, monkeypatch) -> Iterator[httpx.Client]:  # noqa: ANN001
    monkeypatch.setenv(RUNTIME_LORA_ENV, "True")
    yield from serve(workers, tokenizer, ("prefill-0", "decode-0", "decode-1"))


def test_runtime_load_reaches_every_worker_and_is_routed_at_once(runtime_client, workers) -> None:  # noqa: ANN001
    loaded = runtime_client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/a/chat"})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert all(workers[w].lora_calls == ["load chat"] for w in ("prefill-0", "decode-0", "decode-1"))
    assert complete(runtime_client, "chat").status_code == 200  # before any poll saw it
    assert "chat" in [c["id"] for c in runtime_client.get("/v1/models").json()["data"]]
    again = runtime_client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/a/chat"})
    assert again.status_code == 400 and "already been loaded" in again.text
    taken = runtime_client.post("/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": "/a/chat"})
    assert taken.status_code == 400
    removed = runtime_client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'chat' removed successfully."
    assert complete(runtime_client, "chat").status_code == 404
    assert runtime_client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404


def test_a_load_failing_on_one_worker_is_undone_on_the_others(runtime_client, workers) -> None:  # noqa: ANN001
    workers["decode-0"].lora_status = grpc.StatusCode.INVALID_ARGUMENT
    failed = runtime_client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/a/bad"})
    assert failed.status_code == 400
    assert "did not load on worker decode-0: INVALID_ARGUMENT: scripted LoadLoRAAdapter failure" in failed.text
    for name in ("prefill-0", "decode-1"):
        assert workers[name].lora_calls == ["load bad", "unload bad"]
        assert [a.name for a in workers[name].load.lora_adapters] == ["sql"]
    runtime_client.get("/metrics")
    assert complete(runtime_client, "bad").status_code == 404
    bad_body = runtime_client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert bad_body.status_code == 400


def test_metrics_show_each_workers_adapters_and_their_requests(workers, tokenizer) -> None:  # noqa: ANN001
    load = workers["decode-1"].load
    load.max_loras = 2
    load.lora_requests_running.update(sql=3)
    load.lora_requests_waiting.update(sql=1, chat=2)
    for client in serve(workers, tokenizer, ("prefill-0", "decode-0", "decode-1")):
        text = client.get("/metrics").text
    assert ('splitserve:lora_requests_info{max_lora="2",running_lora_adapters="sql",'
            'waiting_lora_adapters="chat,sql",worker="decode-1"} 1.0') in text
    assert 'splitserve:lora_requests{lora_name="chat",state="waiting",worker="decode-1"} 2.0' in text
    assert 'splitserve:lora_requests{lora_name="sql",state="running",worker="decode-1"} 3.0' in text
    assert 'worker="decode-0"' not in "".join(line for line in text.splitlines() if line.startswith("splitserve:lora"))


def test_a_migrated_stream_resumes_under_its_adapter(workers, tokenizer) -> None:  # noqa: ANN001
    from tests.router.fake_worker import Script

    sql = serving_pb2.LoRAAdapter(name="sql", digest="sha256:5", path="/adapters/sql")
    workers["decode-0"].load.lora_adapters.append(sql)  # both decode workers serve it
    workers["decode-0"].load.kv_blocks_free = 100
    workers["decode-1"].load.kv_blocks_free = 50  # decode-0 first (least-loaded), then it goes away
    workers["decode-0"].script = Script(text="Hello world", cut_after=4)
    workers["decode-1"].script = Script(text="o world")
    server = serve_router([info_of(workers[n]) for n in ("prefill-0", "decode-0", "decode-1")], tokenizer,
                          routing_policy="least-loaded")
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            client.get("/metrics")
            body = client.post("/v1/completions", json={"model": "sql", "prompt": "ab", "max_tokens": 11}).json()
    finally:
        server.stop()
    assert body["choices"][0]["text"] == "Hello world"
    (original,), (resumed,) = workers["decode-0"].requests, workers["decode-1"].requests
    assert (original.lora_name, resumed.lora_name) == ("sql", "sql")


def test_a_worker_that_no_longer_holds_the_adapter_is_passed_by(workers, tokenizer) -> None:  # noqa: ANN001
    from tests.router.fake_worker import Script

    sql = serving_pb2.LoRAAdapter(name="sql", digest="sha256:5", path="/adapters/sql")
    workers["decode-0"].load.lora_adapters.append(sql)
    workers["decode-0"].load.kv_blocks_free = 100  # chosen first (least-loaded): it refuses, as a worker whose
    workers["decode-1"].load.kv_blocks_free = 50   # "sql" was reloaded from other files since the last poll would
    workers["decode-0"].script = Script(status=grpc.StatusCode.FAILED_PRECONDITION)
    server = serve_router([info_of(workers[n]) for n in ("prefill-0", "decode-0", "decode-1")], tokenizer,
                          routing_policy="least-loaded")
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            client.get("/metrics")
            assert complete(client, "sql").status_code == 200
            del workers["decode-1"].load.lora_adapters[:]
            client.get("/metrics")
            refused = complete(client, "sql")  # nowhere left: a 503 with the worker's reason
    finally:
        server.stop()
    assert [(r.lora_name, r.lora_digest) for r in workers["decode-1"].requests] == [("sql", "sha256:5")]
    assert refused.status_code == 503 and refused.json()["error"]["message"] == "worker: scripted FAILED_PRECONDITION"


def test_where_workers_disagree_on_an_adapter_the_most_held_wins(workers, tokenizer) -> None:  # noqa: ANN001
    new = serving_pb2.LoRAAdapter(name="sql", digest="sha256:new", path="/adapters/sql-v2")
    del workers["decode-1"].load.lora_adapters[:]
    for name in ("decode-0", "decode-1"):  # the first worker listed (prefill-0) holds the old files, two the new
        workers[name].load.lora_adapters.append(new)
    for client in serve(workers, tokenizer, ("prefill-0", "decode-0", "decode-1")):
        assert client.get("/v1/models/sql").json()["root"] == "/adapters/sql-v2"
        answer = complete(client, "sql")  # no prefill worker holds the new files
        assert answer.status_code == 503 and not workers["decode-0"].requests


def test_a_load_poll_under_way_does_not_undo_a_load_it_predates(runtime_client, workers) -> None:  # noqa: ANN001
    import threading

    from tests.router.fake_worker import Script

    workers["decode-0"].load_delay_s = 0.6  # within the registry's load timeout (1 s)
    poll = threading.Thread(target=lambda: runtime_client.get("/metrics"))  # a scrape polls every worker
    poll.start()
    time.sleep(0.2)  # decode-0's GetLoad is under way, with its load as it was: without "chat"
    loaded = runtime_client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/a/chat"})
    assert loaded.status_code == 200
    poll.join()  # its answer came after the load, and before any later poll's (each takes as long)
    workers["decode-0"].load_delay_s = 0.0
    workers["decode-1"].script = Script(status=grpc.StatusCode.FAILED_PRECONDITION)  # decode-0 must take it
    answer = complete(runtime_client, "chat")
    assert answer.status_code == 200, (answer.text, [len(w.requests) for w in workers.values()])
    assert [r.lora_name for r in workers["decode-0"].requests] == ["chat"]


def test_a_load_that_timed_out_somewhere_is_undone_there_too(runtime_client, workers) -> None:  # noqa: ANN001
    workers["decode-1"].lora_status = grpc.StatusCode.DEADLINE_EXCEEDED
    failed = runtime_client.post("/v1/load_lora_adapter", json={"lora_name": "slow", "lora_path": "/a/slow"})
    assert failed.status_code == 502 and "DEADLINE_EXCEEDED" in failed.text
    assert all(workers[w].lora_calls == ["load slow", "unload slow"] for w in ("prefill-0", "decode-0", "decode-1"))


def test_a_worker_that_lost_a_runtime_adapter_is_given_it_again(runtime_client, workers) -> None:  # noqa: ANN001
    assert runtime_client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/a/chat"}
                               ).status_code == 200
    restarted = workers["decode-1"]
    del restarted.load.lora_adapters[:]  # as a restarted worker reports: its --lora-modules only
    runtime_client.get("/metrics")  # a poll shows the lack
    assert restarted.wait_for(lambda w: w.lora_calls == ["load chat", "load chat"], timeout_s=5)
    assert [a.path for a in restarted.load.lora_adapters] == ["/a/chat"]
    assert runtime_client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    del restarted.load.lora_adapters[:]
    runtime_client.get("/metrics")  # unloaded: nothing to give again
    time.sleep(0.3)
    assert restarted.lora_calls == ["load chat", "load chat", "unload chat"]
