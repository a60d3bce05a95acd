"""`splitserve serve`: flag errors, and the whole lifecycle as a subprocess (ready line, /health, a signal, exit 0,
no process left behind), with stub workers (fast, no model); the real model's end to end is
tests/cluster/test_kernels_before_serving.py."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import cli
from tests.deploy.processes import (
    READY,
    ServeProcess,
    descendants,
    get_status,
    processes_titled,
    stop_and_check,
    wait_until_gone,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# `serve` with the stub workers: the flags after -c are the command's, then the factory's fields as JSON.
STUB_SERVE = """
import json, sys
from deploy.cli import build_parser
from deploy.serve_command import serve, serve_config_from_args
from tests.deploy.stub_worker import StubWorkerFactory
args = build_parser().parse_args(["serve", *sys.argv[2:]])
factory = StubWorkerFactory(**json.loads(sys.argv[1]))
sys.exit(serve(serve_config_from_args(args), factory=factory))
"""
STUB_FLAGS = ["--port", "0", "--prefill-workers", "1", "--decode-workers", "2"]


def stub_serve_argv(**factory: object) -> list[str]:
    return [sys.executable, "-c", STUB_SERVE, json.dumps(factory), *STUB_FLAGS]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-workers", "0"], "--prefill-workers must be at least 1"),
        (["--decode-workers", "-2"], "--decode-workers must be at least 1"),
        (["--colocated", "--decode-workers", "2"], "--colocated runs no prefill or decode workers"),
        (["--colocated-workers", "0"], "--colocated-workers must be at least 1"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--kv-transfer-timeout", "0"], "--kv-transfer-timeout must be positive"),
        (["--block-size", "3"], "block_size must be a positive power of two"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--disagg-prefill-threshold", "-1"], "--disagg-prefill-threshold must be >= 0"),
        (["--max-migrations", "-1"], "--max-migrations must be >= 0"),
        (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
        (["--no-prefix-index", "--redis-url", "redis://127.0.0.1:1/0"], "cannot go with --no-prefix-index"),
        (["--kv-transport", "ipc", "--ray-address", "127.0.0.1:1"], "--kv-transport ipc needs every worker on one host"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve: error: ") and message in err


def test_unknown_choice_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--kv-transport", "carrier-pigeon"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for p in started:
        p.close()


@pytest.mark.ray
@pytest.mark.parametrize(
    ("signals", "expect_code"),
    [([signal.SIGINT], 0), ([signal.SIGTERM, signal.SIGINT], 128 + signal.SIGINT)],
    ids=["SIGINT", "second-signal-forces"],
)
def test_serve_stub_cluster_stops_on_a_signal(
    signals: list[int], expect_code: int, serve_process: list[ServeProcess], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token = "t0ken-for-the-test"
    serve = ServeProcess(stub_serve_argv(), stderr_path=tmp_path / "stderr.txt",
                         env={"SPLITSERVE_ADMIN_TOKEN": token})
    serve_process.append(serve)
    url = serve.wait_ready(90)
    ready = next(line for line in serve.lines if READY.match(line))
    assert "1 prefill, 2 decode workers" in ready
    assert get_status(f"{url}/health") == 200
    if signals == [signal.SIGINT]:  # the scaling rides on one of the two clusters (a serve start costs ~20 s)
        _check_the_admin_api_scales_each_pool(url, token, serve, capsys)
    stop_and_check(serve, signals, expect_code=expect_code)
    assert "splitserve: shutting down" in serve.output()  # our handler ran, not Ray's or Python's default


@pytest.mark.ray
def test_sigterm_while_workers_start_exits_0_promptly(serve_process: list[ServeProcess], tmp_path: Path) -> None:
    serve = ServeProcess(stub_serve_argv(load_delay_s=300), stderr_path=tmp_path / "stderr.txt")
    serve_process.append(serve)
    deadline = time.monotonic() + 90
    while not processes_titled("ray::WorkerHost", under=serve.proc.pid):
        assert serve.proc.poll() is None and time.monotonic() < deadline, serve.output()
        time.sleep(0.2)
    time.sleep(1.0)  # well into the (300 s) "model load"
    began = time.monotonic()
    stop_and_check(serve, [signal.SIGTERM], expect_code=0)
    assert time.monotonic() - began < 30
    assert serve.url is None


@pytest.mark.ray
def test_workers_that_fail_to_start_exit_1_with_the_reason(
    serve_process: list[ServeProcess], tmp_path: Path
) -> None:
    serve = ServeProcess(stub_serve_argv(fail_roles=["decode"]), stderr_path=tmp_path / "stderr.txt")
    serve_process.append(serve)
    tree: dict[int, int] = {}
    while serve.proc.poll() is None:  # collect its processes while it runs, to check none outlives it
        tree.update(descendants(serve.proc.pid))
        time.sleep(0.2)
    assert serve.proc.returncode == 1
    assert "splitserve: error: workers failed to start: decode-0: RuntimeError: stub refuses" in serve.output()
    assert not wait_until_gone(tree, session=serve.proc.pid, timeout_s=15)


def _admin(url: str, path: str, token: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"{url}{path}", method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def _check_the_admin_api_scales_each_pool(url: str, token: str, serve: ServeProcess,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`splitserve scale` and /admin/* on a running stub cluster (1 prefill, 2 decode): Ray, the controller actor
    and the gateway wired together."""
    assert cli.main(["scale", "--url", url, "--decode", "3", "--admin-token", token]) == 0
    assert "decode-2" in capsys.readouterr().out
    pools = _admin(url, "/admin/pools", token)["workers"]
    assert [(w["worker_id"], w["role"], w["state"]) for w in pools] == [
        ("prefill-0", "prefill", "serving"), ("decode-0", "decode", "serving"), ("decode-1", "decode", "serving"),
        ("decode-2", "decode", "serving")]
    assert all(w["pid"] in descendants(serve.proc.pid) and w["endpoint"] and w["incarnation"] for w in pools)
    workers = _admin(url, "/admin/scale", token, {"decode": 1, "prefill": 2})["workers"]
    assert [w["worker_id"] for w in workers] == ["prefill-0", "decode-0", "prefill-1"]
    try:
        _admin(url, "/admin/pools", "wrong")
    except urllib.error.HTTPError as error:
        assert error.code == 401
    else:
        raise AssertionError("a wrong token was let in")


def test_speculative_config_reaches_every_workers_engine_config() -> None:
    from deploy.cli import build_parser
    from deploy.serve_command import serve_config_from_args
    from engine.config import SpeculativeConfig

    flags = ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    config = serve_config_from_args(build_parser().parse_args(flags))
    assert config.controller.engine.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram", "k": 3}'])


def test_the_scheduling_policy_and_max_logprobs_reach_the_workers_and_the_gateway() -> None:
    from deploy.cli import build_parser
    from deploy.serve_command import serve_config_from_args
    from deploy.worker_directory import served_engine

    for flags, policy in ((["serve"], "fcfs"), (["serve", "--scheduling-policy", "priority", "--colocated"], "priority")):
        config = serve_config_from_args(build_parser().parse_args(flags))
        assert config.controller.engine.scheduling_policy == policy
        assert served_engine(config.controller).scheduling_policy == policy  # the gateway's queue and its 400s
    config = serve_config_from_args(build_parser().parse_args(["serve", "--max-logprobs", "-1"]))
    assert config.controller.engine.max_logprobs == served_engine(config.controller).max_logprobs == -1


def test_a_vllm_command_lines_logging_and_compat_flags_are_taken() -> None:
    from deploy.cli import build_parser
    from deploy.serve_command import serve_config_from_args

    flags = ["serve", "--enable-log-requests", "--max-log-len", "100", "--uvicorn-log-level", "info",
             "--enable-chunked-prefill", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    gateway = serve_config_from_args(build_parser().parse_args(flags)).gateway
    assert (gateway.enable_log_requests, gateway.max_log_len, gateway.uvicorn_log_level) == (True, 100, "info")
    assert not serve_config_from_args(build_parser().parse_args(["serve", "--disable-log-requests"])).gateway \
        .enable_log_requests
    with pytest.raises(ValueError, match="--disable-log-requests and --enable-log-requests"):
        serve_config_from_args(build_parser().parse_args(["serve", "--disable-log-requests",
                                                          "--enable-log-requests"]))
    with pytest.raises(ValueError, match="--max-log-len must be >= 0"):
        serve_config_from_args(build_parser().parse_args(["serve", "--max-log-len", "-1"]))


@pytest.mark.parametrize(("flags", "share"), [([], 0.45), (["--colocated"], 0.9),
                                               (["--prefill-workers", "2", "--decode-workers", "1"], 0.3),
                                               (["--gpu-memory-utilization", "0.4"], 0.4)])
def test_workers_sharing_one_gpu_split_the_default_share(flags: list[str], share: float) -> None:
    """`serve --device cuda` on one machine: every worker's engine is on its GPU, so each takes an equal part of
    vLLM's default 0.9 (a given share is each worker's own); on cpu nothing changes."""
    from deploy.cli import build_parser
    from deploy.serve_command import serve_config_from_args

    def engine(*extra: str):
        return serve_config_from_args(build_parser().parse_args(["serve", *extra])).controller.engine

    assert engine("--device", "cuda", *flags).gpu_memory_utilization == share
    assert engine("--device", "cpu", *flags).gpu_memory_utilization == (0.4 if "0.4" in flags else 0.9)


def test_gpu_memory_utilization_reaches_every_workers_engine_config() -> None:
    """Each worker (every pool's workers get the controller's engine config) takes this share of its GPU, as in
    vLLM: a prefill and a decode worker sharing one GPU each need theirs, e.g. 0.45."""
    from deploy.cli import build_parser
    from deploy.serve_command import serve_config_from_args

    config = serve_config_from_args(build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.45"]))
    assert config.controller.engine.gpu_memory_utilization == 0.45
    assert config.controller.engine.kv_cache_memory_bytes is None  # unset: sized from the share on cuda
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        serve_config_from_args(build_parser().parse_args(["serve", "--gpu-memory-utilization", "1.5"]))
