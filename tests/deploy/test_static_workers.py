"""`splitserve gateway` over a fixed worker list (deploy/static_workers.py), without processes: the flags' validation,
the checks of the workers' Health answers (pure), and the provider over fake gRPC workers (discovery, a restart
at the same address, a refused newcomer, no scaling). The real processes: tests/deploy/test_static_gateway.py."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from deploy import cli
from deploy.gateway_app import ServedEngine
from deploy.static_workers import (
    StaticWorkers,
    WorkerList,
    check_workers,
    worker_list_from_args,
)
from protos import serving_pb2
from protos.cluster_auth import OPEN
from protos.worker_info import WorkerInfo
from tests.router.conftest import dead_endpoint
from tests.router.fake_worker import FakeWorker

P, D, C = "127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["gateway", *argv])


def test_the_flags_give_a_worker_list() -> None:
    workers = worker_list_from_args(_args("--prefill", P, "--decode", D, "--decode", "host-b:50051"))
    assert workers == WorkerList(prefill=(P,), decode=(D, "host-b:50051"))
    assert workers.mode == "disaggregated"
    assert workers.endpoints() == [("prefill", P), ("decode", D), ("decode", "host-b:50051")]
    colocated = worker_list_from_args(_args("--colocated", C, "--colocated", "[::1]:7000"))
    assert colocated == WorkerList(colocated=(C, "[::1]:7000")) and colocated.mode == "colocated"
    assert worker_list_from_args(_args("--ray-address", "head:6379")) is None  # the controller's path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give the workers: --ray-address HOST:PORT .* or a fixed list"),
        (["--ray-address", "head:6379", "--prefill", P, "--decode", D], "give one or the other"),
        (["--prefill", P], "--prefill needs --decode too"),
        (["--decode", D, "--decode", "127.0.0.1:5004"], "--decode needs --prefill too"),
        (["--colocated", C, "--prefill", P, "--decode", D], "either --colocated or --prefill and --decode"),
        (["--prefill", "http://127.0.0.1:5001", "--decode", D], "--prefill 'http://127.0.0.1:5001': expected HOST:PORT"),
        (["--prefill", P, "--decode", "127.0.0.1:70000"], "--decode '127.0.0.1:70000': expected HOST:PORT"),
        (["--prefill", P, "--decode", P], "127.0.0.1:5001 is given twice"),
        (["--colocated", C, "--start-ray", "ray start --address=h:6379"], "--start-ray is for --ray-address"),
        (["--colocated", C, "--worker-wait-timeout", "0"], "--worker-wait-timeout must be positive"),
        (["--ray-address", "head:6379", "--redis-url", "redis://r:6379"], "--redis-url goes with a fixed worker list"),
    ],
)
def test_bad_worker_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker_list_from_args(_args(*argv))


def test_the_command_exits_2_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gateway", "--prefill", P]) == 2
    assert "splitserve: error: --prefill needs --decode too" in capsys.readouterr().err


def _health(worker_id: str, role: str, *, incarnation: int = 7, **engine: object) -> serving_pb2.HealthResponse:
    fields = {"engine_model": "smollm2-135m", "load_format": "auto", "block_size": 16, "max_model_len": 1024,
              "kv_cache_dtype": "auto"}
    return serving_pb2.HealthResponse(ok=True, worker_id=worker_id, role=role, model="SmolLM2-135M",
                                      incarnation=incarnation, **{**fields, **engine})  # type: ignore[arg-type]


def test_the_workers_own_ids_and_incarnations_and_their_engine_are_taken() -> None:
    workers = WorkerList(prefill=(P,), decode=(D,))
    infos, served = check_workers(workers, {P: _health("prefill-a", "prefill", incarnation=11),
                                            D: _health("decode-b", "decode", incarnation=12)})
    assert infos == [WorkerInfo(worker_id="prefill-a", role="prefill", endpoint=P, incarnation=11),
                     WorkerInfo(worker_id="decode-b", role="decode", endpoint=D, incarnation=12)]
    assert served == ServedEngine(model="smollm2-135m", load_format="auto", block_size=16, max_model_len=1024,
                                  mode="disaggregated")
    _, served = check_workers(WorkerList(colocated=(C,)), {C: _health("c", "colocated", load_format="dummy")})
    assert served.mode == "colocated" and served.load_format == "dummy" and served.scheduling_policy == "fcfs"
    _, served = check_workers(WorkerList(colocated=(C,)), {C: _health("c", "colocated", scheduling_policy="priority")})
    assert served.scheduling_policy == "priority"  # the gateway's queue then goes by priority, and 400s none
    assert served.max_logprobs == 20  # a worker from before --max-logprobs: vLLM's default
    _, served = check_workers(WorkerList(colocated=(C,)), {C: _health("c", "colocated", max_logprobs=-1)})
    assert served.max_logprobs == -1


@pytest.mark.parametrize(
    ("decode_answer", "message"),
    [
        (_health("decode-b", "prefill"),
         "--decode 127.0.0.1:5002: that worker \\(decode-b\\) is a prefill worker; give it as --prefill"),
        (_health("decode-b", "colocated"), "is a colocated worker; give it as --colocated"),
        (_health("decode-b", "decode", engine_model="qwen2.5-0.5b"),
         "different engines: .* model 'smollm2-135m' vs 'qwen2.5-0.5b'"),
        (_health("decode-b", "decode", block_size=32), "differ in block size 16 vs 32"),
        (_health("decode-b", "decode", max_model_len=2048), "differ in max model len 1024 vs 2048"),
        (_health("decode-b", "decode", load_format="dummy"), "differ in load format 'auto' vs 'dummy'"),
        (_health("decode-b", "decode", kv_cache_dtype="int8"), "differ in KV cache dtype 'auto' vs 'int8'"),
        (_health("decode-b", "decode", scheduling_policy="priority"),
         "differ in scheduling policy 'fcfs' vs 'priority'"),
        (_health("decode-b", "decode", max_logprobs=5), "differ in max logprobs 20 vs 5"),
        (_health("prefill-a", "decode"), "worker id\\(s\\) prefill-a answer at more than one endpoint"),
        (serving_pb2.HealthResponse(ok=True, worker_id="old", role="decode"), "does not report its engine"),
    ],
)
def test_mismatched_workers_are_refused(decode_answer: serving_pb2.HealthResponse, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_workers(WorkerList(prefill=(P,), decode=(D,)), {P: _health("prefill-a", "prefill"), D: decode_answer})


@pytest.fixture
def fakes() -> Iterator[tuple[FakeWorker, FakeWorker]]:
    prefill, decode = FakeWorker(worker_id="prefill-a", role="prefill"), FakeWorker(worker_id="decode-b", role="decode")
    prefill.health, decode.health = _health("prefill-a", "prefill"), _health("decode-b", "decode")
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_the_provider_follows_a_restart_and_refuses_a_different_worker(fakes) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = fakes
    workers = StaticWorkers(WorkerList(prefill=(prefill.endpoint,), decode=(decode.endpoint,)), auth=OPEN,
                            health_timeout_s=1.0)
    try:
        assert workers() == []  # before discovery
        served = workers.discover(timeout_s=5.0)
        assert served is not None and served.model == "smollm2-135m"
        assert [(i.worker_id, i.incarnation) for i in workers()] == [("prefill-a", 7), ("decode-b", 7)]
        decode.health = _health("decode-b2", "decode", incarnation=8)  # restarted at the same address
        assert [(i.worker_id, i.incarnation) for i in workers()] == [("prefill-a", 7), ("decode-b2", 8)]
        decode.health = _health("decode-b3", "prefill", incarnation=9)  # something else there now: not taken
        assert [(i.worker_id, i.role) for i in workers()][1] == ("decode-b2", "decode")
        decode.health = _health("decode-b3", "decode", incarnation=9, block_size=32)
        assert workers()[1].worker_id == "decode-b2"
        decode.stop()  # gone: still listed as it was (the registry's load poll marks it unhealthy)
        assert [i.worker_id for i in workers()] == ["prefill-a", "decode-b2"]
        assert [(w.worker_id, w.state) for w in workers.pool_workers()] == [("prefill-a", "serving"),
                                                                           ("decode-b2", "serving")]
        assert workers.restart_counts() == []
        with pytest.raises(RuntimeError, match="fixed worker list"):
            workers.scale("decode", 2)
    finally:
        workers.close()


def test_discovery_names_the_workers_that_never_answered(fakes) -> None:  # type: ignore[no-untyped-def]
    prefill, _ = fakes
    dead = dead_endpoint()
    workers = StaticWorkers(WorkerList(prefill=(prefill.endpoint,), decode=(dead,)), auth=OPEN, health_timeout_s=0.5)
    try:
        with pytest.raises(TimeoutError, match=f"within 1 s \\(--worker-wait-timeout\\): {dead} \\(UNAVAILABLE"):
            workers.discover(timeout_s=1.0)
        prefill.health = serving_pb2.HealthResponse(ok=False, worker_id="prefill-a", role="prefill")
        with pytest.raises(TimeoutError, match=f"{prefill.endpoint} \\(answers Health not ok"):
            workers.discover(timeout_s=0.5)
    finally:
        workers.close()
