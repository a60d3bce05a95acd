"""`serve`'s security flags: the cluster secret (random per cluster, or given) reaches every worker's config and
no command line or child environment; API key and TLS flags; Redis with a password, against a real
`redis-server --requirepass` (right password serves, a wrong or missing one stops serve at start-up, clearly)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.redis_server import EmbeddedRedis, redact_url
from deploy.serve_command import serve, serve_config_from_args
from protos.cluster_auth import CLUSTER_SECRET_ENV

PASSWORD = "redis-password-for-tests"


def _config(*flags: str):
    return serve_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_a_random_cluster_secret_per_cluster_unless_one_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    first, second = _config().controller.auth, _config().controller.auth
    assert len(first.secret) >= 32 and first.secret != second.secret
    assert first.secret not in repr(_config().controller)
    assert _config("--cluster-secret", "given-secret").controller.auth.secret == "given-secret"
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "from-the-environment")
    monkeypatch.setenv("SPLITSERVE_API_KEY", "sk-env")
    config = _config()
    assert config.controller.auth.secret == "from-the-environment"
    assert config.gateway.api_keys == ("sk-env",)
    # the workers get the secret in their config, not from the environment serve hands them
    assert CLUSTER_SECRET_ENV not in config.controller.worker_env
    assert "SPLITSERVE_API_KEY" not in config.controller.worker_env


def test_the_secret_reaches_every_workers_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.controller import ClusterController

    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    config = _config("--grpc-tls-cert", "c.pem", "--grpc-tls-key", "k.pem", "--grpc-tls-ca", "ca.pem")
    controller = ClusterController(config.controller)
    workers = controller._new_configs("prefill", 1) + controller._new_configs("decode", 2)
    assert {w.auth for w in workers} == {config.controller.auth}
    assert config.controller.auth.tls and config.controller.auth.secret


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rate-limit-requests-per-minute", "10"], "per API key"),
        (["--metrics-require-key"], "per API key"),
        (["--ssl-keyfile", "k.pem"], "both --ssl-keyfile and --ssl-certfile"),
        (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs needs"),
        (["--grpc-tls-cert", "c.pem"], "--grpc-tls-key and --grpc-tls-ca"),
        (["--api-key", "k", "--rate-limit-tokens-per-minute", "0"], "must be positive"),
    ],
)
def test_bad_security_flags(flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message):
        _config(*flags)


def test_security_flags_reach_the_config(tmp_path: Path) -> None:
    config = _config("--api-key", "a", "--api-key", "b", "--api-key-file", str(tmp_path / "keys"),
                     "--metrics-require-key", "--rate-limit-requests-per-minute", "30",
                     "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem")
    assert config.gateway.api_keys == ("a", "b") and config.gateway.api_key_file == str(tmp_path / "keys")
    assert config.gateway.metrics_require_key and config.gateway.rate_limits.requests_per_minute == 30
    assert config.gateway.tls is not None and config.gateway.tls.ca_certs == "ca.pem"
    assert "'a'" not in repr(config)


@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password=PASSWORD) as server:
        yield server


def test_redis_requirepass_right_password_works(redis_with_password: EmbeddedRedis) -> None:
    import redis

    url = redis_with_password.url
    assert url == f"redis://:{PASSWORD}@127.0.0.1:{redis_with_password.port}/0"
    with redis.Redis.from_url(url) as client:
        assert client.ping()
    with open(f"/proc/{redis_with_password.pid}/cmdline", "rb") as f:  # the password is in no command line
        assert PASSWORD.encode() not in f.read()
    assert PASSWORD not in repr(redis_with_password)


@pytest.mark.parametrize(
    ("password", "message"),
    [("wrong-password", "refused the credentials"), (None, "needs a password")],
    ids=["wrong", "missing"],
)
def test_redis_wrong_password_stops_serve_at_start_up(
    redis_with_password: EmbeddedRedis, password: str | None, message: str
) -> None:
    auth = f":{password}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{redis_with_password.port}/0"
    # serve itself: it checks --redis-url before it starts Ray or any worker (the CLI makes this exit 2)
    with pytest.raises(ValueError, match=message) as refused:
        serve(_config("--redis-url", url, "--port", "0"))
    assert password is None or password not in str(refused.value)
    assert "***" in str(refused.value) or password is None


def test_redact_url() -> None:
    assert redact_url("rediss://user:pw@host:6380/1") == "rediss://user:***@host:6380/1"
    assert redact_url("redis://:pw@h/0") == "redis://:***@h/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert os.environ.get(CLUSTER_SECRET_ENV, "") not in ("pw",)
