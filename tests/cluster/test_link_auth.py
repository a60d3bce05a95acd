"""Real prefill and decode workers (tiny random-weight model, real gRPC, in this process) behind a cluster secret:

- every worker RPC without the secret, or with a wrong one, is UNAUTHENTICATED and does nothing: no request
  reaches an engine, no KV block is allocated, no transfer is counted;
- KV pushed at a decode worker by anyone but the prefill worker it asked — an unknown transfer, a known transfer
  from the wrong sender, with the wrong layout, with a bad checksum — is refused and counted
  (`kv_transfers_rejected`), every block comes back, and the next requests sharing the prompt's prefix give the
  offline engine's greedy tokens, as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from engine.request.sampling_params import SamplingParams
from engine.request.wire import sampling_params_to_proto
from kv_transfer.base import TransferFault
from kv_transfer.grpc_link import SERVICE, TRANSFER_METHOD
from kv_transfer.grpc_transport import Sender
from kv_transfer.layout import KVChecksumError, KVHandoff, KVLayoutMismatch, KVTransferError
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc, serving_pb2, serving_pb2_grpc
from protos.cluster_auth import OPEN, ClusterAuth, sync_channel
from tests.cluster.worker_harness import generate, start_worker, stub
from tests.engine.tiny_model import TINY_ENGINE, drain, finals, make_engine, write_tiny_checkpoint

AUTH = ClusterAuth(secret="the-cluster-secret")
WRONG = ClusterAuth(secret="not-the-cluster-secret")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks of 4 and one partial
SHARED = PROMPT[:12] + list(range(40, 49))  # the same first 3 blocks, then its own 9 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from engine.loader.checkpoint import load_checkpoint

    return load_checkpoint(str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")),
                           dtype=torch.float32)


@pytest.fixture(scope="module")
def workers(checkpoint) -> Iterator[tuple[object, object]]:
    engine = {**TINY_ENGINE, "model": str(checkpoint.path), "num_threads": 1}
    prefill = start_worker("prefill", checkpoint, auth=AUTH, **engine)
    decode = start_worker("decode", checkpoint, auth=AUTH, **engine)
    yield prefill, decode
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[int]]:
    """The offline engine's greedy tokens for both prompts."""
    engine = make_engine(checkpoint, num_threads=1)
    engine.add_request("prompt", PROMPT, GREEDY)
    engine.add_request("shared", SHARED, GREEDY)
    return {rid: out.token_ids for rid, out in finals(drain(engine)).items()}


def _wait_all_free(*workers: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(w.runtime.engine.block_pool.num_used_blocks for w in workers):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "KV blocks still in use"
        time.sleep(0.02)


def _request(request_id: str, prompt: list[int], prefill_endpoint: str = "") -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                       params=sampling_params_to_proto(GREEDY), prefill_endpoint=prefill_endpoint)


@pytest.mark.parametrize("auth", [OPEN, WRONG], ids=["no_secret", "wrong_secret"])
def test_every_worker_rpc_needs_the_secret(workers, auth: ClusterAuth) -> None:
    prefill, decode = workers
    before = {w.role: stub(w, AUTH).GetLoad(serving_pb2.LoadRequest(), timeout=10) for w in (prefill, decode)}
    calls = []
    for worker in (prefill, decode):
        s = stub(worker, auth)
        calls += [
            lambda s=s: s.Health(serving_pb2.HealthRequest(), timeout=10),
            lambda s=s: s.GetLoad(serving_pb2.LoadRequest(), timeout=10),
            lambda s=s: s.Abort(serving_pb2.AbortRequest(request_id="x"), timeout=10),
            lambda s=s: list(s.Generate(_request("unauth", PROMPT, prefill.endpoint), timeout=10)),
            lambda s=s: s.Prefill(serving_pb2.PrefillRequest(request=_request("unauth", PROMPT),
                                                             decode_endpoint=decode.endpoint, transfer_id="t"),
                                  timeout=10),
        ]
    channel = sync_channel(decode.endpoint, auth)  # the KV receiver: a bogus push
    transfer = channel.stream_unary(TRANSFER_METHOD,
                                    request_serializer=kv_transfer_pb2.KVTransferMessage.SerializeToString,
                                    response_deserializer=kv_transfer_pb2.KVTransferAck.FromString)
    bogus = kv_transfer_pb2.KVTransferMessage(descriptor=kv_transfer_pb2.KVHandoffDescriptor(request_id="x"))
    calls.append(lambda: transfer(iter([bogus]), timeout=10))
    for call in calls:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    channel.close()
    for worker in (prefill, decode):  # nothing happened: no request, no block, no transfer, no refusal counted
        after = stub(worker, AUTH).GetLoad(serving_pb2.LoadRequest(), timeout=10)
        assert after.kv_blocks_used == 0 and after.num_requests_running == 0 and after.num_requests_waiting == 0
        assert after.prefix_cache_queries == before[worker.role].prefix_cache_queries
        assert after.num_kv_transfers == before[worker.role].num_kv_transfers
        assert dict(after.kv_transfers_rejected) == dict(before[worker.role].kv_transfers_rejected)
    assert SERVICE in TRANSFER_METHOD


def test_the_torch_transports_control_calls_need_the_secret(checkpoint) -> None:
    """Its pair groups are joined only under a key handed out by Open: no Open, no key."""
    engine = {**TINY_ENGINE, "model": str(checkpoint.path), "num_threads": 1}
    decode = start_worker("decode", checkpoint, transport="torch", auth=AUTH, worker_id="decode-torch", **engine)
    try:
        for auth in (OPEN, WRONG):
            with sync_channel(decode.endpoint, auth) as channel:
                receiver = kv_transfer_pb2_grpc.KVReceiverStub(channel)
                for call in (lambda: receiver.Open(kv_transfer_pb2.KVHandoffDescriptor(request_id="x"), timeout=10),
                             lambda: receiver.Commit(kv_transfer_pb2.KVCommit(transfer_id="x"), timeout=10)):
                    with pytest.raises(grpc.RpcError) as refused:
                        call()
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with sync_channel(decode.endpoint, AUTH) as channel:  # with it, Open is answered (and refused: no such
            opened = kv_transfer_pb2_grpc.KVReceiverStub(channel).Open(  # transfer was reserved), no pair key
                KVHandoff(request_id="x", transfer_id="t", num_tokens=4, layout=decode.runtime.layout).to_proto(),
                timeout=10)
            assert not opened.ok and not opened.pair_key and "no blocks are reserved" in opened.error
        stats = stub(decode, AUTH).GetLoad(serving_pb2.LoadRequest(), timeout=10)
        assert dict(stats.kv_transfers_rejected) == {"unknown_transfer": 1}
    finally:
        decode.stop()


class AttackingPrefill(serving_pb2_grpc.WorkerServicer):
    """Stands where the decode worker expects a prefill worker: on Prefill it pushes KV that must be refused, in
    every way, with the cluster secret (an insider, or a stolen secret), then reports a failure."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.errors: dict[str, Exception] = {}
        self.endpoint = ""

    def Prefill(self, request: serving_pb2.PrefillRequest, context: grpc.ServicerContext
                ) -> serving_pb2.PrefillResponse:
        gen = request.request
        handoff = KVHandoff(request_id=gen.request_id, transfer_id=request.transfer_id,
                            num_tokens=len(gen.prompt_token_ids), layout=self.layout,
                            first_block=request.decode_cached_blocks, source_endpoint=self.endpoint)
        junk = _Junk(self.layout)
        wider = dataclasses.replace(self.layout, num_kv_heads=self.layout.num_kv_heads * 2)
        pushes = {
            "unknown_transfer": dataclasses.replace(handoff, transfer_id="f" * 32),
            "unknown_request": dataclasses.replace(handoff, request_id="nobody-reserved-this"),
            "wrong_source": dataclasses.replace(handoff, source_endpoint="10.9.8.7:6543"),
            "layout_mismatch": dataclasses.replace(handoff, layout=wider),
        }
        sender = Sender(worker_id="intruder", device=torch.device("cpu"), auth=AUTH)
        corrupting = Sender(worker_id="intruder", device=torch.device("cpu"), auth=AUTH,
                            fault=TransferFault(corrupt_block=handoff.first_block))
        try:
            for name, forged in pushes.items():
                self.errors[name] = _refused(lambda f=forged: sender.send(f, junk, endpoint=request.decode_endpoint,
                                                                           timeout_s=10))
            self.errors["checksum"] = _refused(lambda: corrupting.send(handoff, junk, endpoint=request.decode_endpoint,
                                                                       timeout_s=10))
        finally:
            sender.close()
            corrupting.close()
        return serving_pb2.PrefillResponse(request_id=gen.request_id, first_token_id=5, error="refused, as it must be")


class _Junk:
    def __init__(self, layout) -> None:
        self.layout = layout

    def read_block(self, index: int) -> torch.Tensor:
        return torch.full(self.layout.block_shape, 7.0 + index)  # [num_layers, 2, block_size, kv_heads, head_dim]


def _refused(push) -> Exception:
    try:
        push()
    except KVTransferError as exc:
        return exc
    raise AssertionError("a forged KV push was accepted")


@pytest.fixture
def attacker(workers) -> Iterator[AttackingPrefill]:
    _, decode = workers
    servicer = AttackingPrefill(decode.runtime.layout)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    serving_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    servicer.endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield servicer
    server.stop(0).wait()


def test_kv_nobody_asked_for_is_refused_and_poisons_nothing(workers, attacker, reference) -> None:
    prefill, decode = workers
    decode_stub = stub(decode, AUTH)
    assert generate(decode_stub, "before", PROMPT, GREEDY, prefill.endpoint).token_ids == reference["prompt"]
    rejected_before = dict(decode_stub.GetLoad(serving_pb2.LoadRequest(), timeout=10).kv_transfers_rejected)

    with pytest.raises(grpc.RpcError) as aborted:  # the decode worker asks the attacker for SHARED's KV
        list(decode_stub.Generate(_request("attacked", SHARED, attacker.endpoint), timeout=30))
    assert aborted.value.code() == grpc.StatusCode.ABORTED
    assert set(attacker.errors) == {"unknown_transfer", "unknown_request", "wrong_source", "layout_mismatch",
                                    "checksum"}
    assert isinstance(attacker.errors["layout_mismatch"], KVLayoutMismatch)
    assert isinstance(attacker.errors["checksum"], KVChecksumError)
    assert "no transfer" in str(attacker.errors["unknown_transfer"])
    assert "no blocks are reserved" in str(attacker.errors["unknown_request"])
    assert "10.9.8.7:6543" in str(attacker.errors["wrong_source"])

    _wait_all_free(prefill, decode)
    rejected = dict(decode_stub.GetLoad(serving_pb2.LoadRequest(), timeout=10).kv_transfers_rejected)
    delta = {reason: n - rejected_before.get(reason, 0) for reason, n in rejected.items()}
    assert {r: n for r, n in delta.items() if n} == {"unknown_transfer": 2, "wrong_source": 1,
                                                      "layout_mismatch": 1, "checksum": 1}
    # Nothing of it reached the prefix cache: both prompts, through the real prefill worker, as before.
    assert generate(decode_stub, "after-shared", SHARED, GREEDY, prefill.endpoint).token_ids == reference["shared"]
    assert generate(decode_stub, "after", PROMPT, GREEDY, prefill.endpoint).token_ids == reference["prompt"]
    _wait_all_free(prefill, decode)


def test_the_gateway_reaches_the_workers_only_with_the_secret(workers, checkpoint, reference) -> None:
    """The whole path in this process: openai client ─API key─▶ gateway ─secret─▶ decode ─secret─▶ prefill
    ─secret─▶ decode's KV receiver. A gateway holding a wrong secret finds no healthy worker."""
    import httpx
    import openai

    from protos.worker_info import WorkerInfo
    from engine.tokenizer.tokenizer import Tokenizer
    from router.api_keys import AccessControl, ApiKeyRing
    from router.app import create_app
    from router.config import RouterConfig
    from router.server import RouterServer
    from router.worker_registry import WorkerRegistry

    tokenizer = Tokenizer.from_hf_dir(Path(checkpoint.path))
    infos = [WorkerInfo(worker_id=w.worker_id, role=w.role, endpoint=w.endpoint) for w in workers]
    config = RouterConfig(served_model_names=("tiny",), max_model_len=TINY_ENGINE["max_model_len"],
                          block_size=TINY_ENGINE["block_size"], routing_policy="least-loaded", queue_timeout_s=1.0,
                          disagg_prefill_threshold_tokens=0)
    for auth, healthy in ((AUTH, True), (WRONG, False)):
        app = create_app(config, WorkerRegistry(lambda: infos, refresh_interval_s=0.5, auth=auth), tokenizer,
                         access=AccessControl(ring=ApiKeyRing(["sk-gateway"])))
        server = RouterServer(app).start()
        try:
            assert (httpx.get(f"{server.url}/health", timeout=10).status_code == 200) is healthy
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-gateway", max_retries=0, timeout=60)
            request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                       "extra_body": {"ignore_eos": True, "skip_special_tokens": False}}
            if not healthy:
                with pytest.raises(openai.APIStatusError) as refused:
                    client.completions.create(**request)
                assert refused.value.status_code == 503
                continue
            completion = client.completions.create(**request)
            assert completion.usage is not None and completion.usage.completion_tokens == 6
            assert completion.choices[0].text == tokenizer.decode(reference["prompt"], skip_special_tokens=False)
            streamed = list(client.completions.create(**request, stream=True))  # a stream through the interceptor
            assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
        finally:
            server.stop()
    _wait_all_free(*workers)
