"""The gateway's flags against its config (deploy/config_flags.py, deploy/serve_args.py): each flag sets the
GatewayConfig field it names and takes that field's default; a bad value is the field's check, named by the flag."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from deploy.autoscale_args import AUTOSCALE_WINDOW
from deploy.cli import build_parser
from deploy.config_flags import ConfigFlag, add_config_flags, config_from_flags, field_default
from deploy.serve_args import GATEWAY_FLAGS, SECURITY_FLAGS, gateway_config_from_args
from router.config import GatewayConfig

FLAGS = (*GATEWAY_FLAGS, *SECURITY_FLAGS, AUTOSCALE_WINDOW)


@pytest.fixture(autouse=True)
def _no_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gateway` takes its defaults from SPLITSERVE_* (deploy/env_defaults.py): here, the code's own."""
    for name in [n for n in os.environ if n.startswith("SPLITSERVE_")]:
        monkeypatch.delenv(name)


def _actions(command: str) -> dict[str, argparse.Action]:
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {option: action for action in subparsers.choices[command]._actions for option in action.option_strings}


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_each_flag_sets_a_field_and_takes_its_default(command: str) -> None:
    actions = _actions(command)
    fields = {f.name for f in dataclasses.fields(GatewayConfig)}
    for flag in FLAGS:
        if flag is AUTOSCALE_WINDOW and command == "gateway":
            continue  # serve's autoscaling group only
        assert flag.field in fields, flag
        assert actions[flag.option].dest == flag.dest
        assert actions[flag.option].default == field_default(GatewayConfig, flag.field), flag.option
    # no flags: the config's own defaults, every one
    args = build_parser().parse_args([command] if command == "serve" else [command, "--colocated", "127.0.0.1:9"])
    assert gateway_config_from_args(args) == GatewayConfig()


def test_flags_reach_their_fields() -> None:
    args = build_parser().parse_args([
        "gateway", "--colocated", "127.0.0.1:9", "--host", "::1", "--port", "0", "--request-timeout", "9",
        "--no-admission-control", "--max-queued-requests", "3", "--queue-timeout", "1.5", "--max-migrations", "0",
        "--admin-token", "t", "--routing-policy", "round-robin", "--disagg-prefill-threshold", "0",
        "--api-key", "k", "--api-key-file", "keys", "--metrics-require-key", "--served-model-name", "llama", "l3",
        "--chat-template", "chat.jinja", "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0.5}'])
    config = gateway_config_from_args(args)
    assert config == dataclasses.replace(
        GatewayConfig(), host="::1", port=0, request_timeout_s=9.0, admission_control=False, max_queued_requests=3,
        queue_timeout_s=1.5, max_migrations=0, admin_token="t", routing_policy="round-robin",
        disagg_prefill_threshold_tokens=0, api_keys=("k",), api_key_file="keys", metrics_require_key=True,
        served_model_names=("llama", "l3"), chat_template="chat.jinja", generation_config="vllm",
        override_generation_config='{"temperature": 0.5}')


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--queue-timeout", "0"], "--queue-timeout must be positive, got 0.0"),
        (["--request-timeout", "-1"], "--request-timeout must be positive, got -1.0"),
        (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0, got -1"),
        (["--port", "65536"], "--port must be in 0..65535, got 65536"),
        (["--served-model-name", "a", "a"], "--served-model-name names a model twice: ('a', 'a')"),
        (["--served-model-name", "a", ""], "--served-model-name must be non-empty names, got ('a', '')"),
    ],
)
def test_a_bad_value_is_named_by_its_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        gateway_config_from_args(build_parser().parse_args(["gateway", "--colocated", "127.0.0.1:9", *flags]))
    assert str(raised.value) == message


def test_a_field_without_a_flag_keeps_its_own_name_in_the_error() -> None:
    parser = argparse.ArgumentParser()
    flag = ConfigFlag("--queue-timeout", "queue_timeout_s", "seconds", type=float)
    add_config_flags(parser, GatewayConfig, [flag])
    args = parser.parse_args([])
    assert config_from_flags(GatewayConfig, [flag], args).queue_timeout_s == 30.0
    with pytest.raises(ValueError, match="^max_migrations must be >= 0, got -1$"):
        config_from_flags(GatewayConfig, [flag], args, max_migrations=-1)
