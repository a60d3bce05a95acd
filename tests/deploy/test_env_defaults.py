"""Flags from SPLITSERVE_* variables (deploy/env_defaults.py) for `splitserve head` and `splitserve gateway`."""

from __future__ import annotations

import argparse

import pytest

from deploy import cli
from deploy.env_defaults import apply_env_defaults, env_name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--prefill-workers", type=int, default=None)
    p.add_argument("--kv-transport", default="grpc", choices=("grpc", "torch"))
    p.add_argument("--admission-control", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--colocated", action="store_true")
    p.add_argument("--queue-timeout", type=float, default=30.0)
    return p


def test_names() -> None:
    assert env_name("--prefill-workers") == "SPLITSERVE_PREFILL_WORKERS"


def test_a_variable_sets_the_default_and_a_flag_still_wins() -> None:
    p = _parser()
    apply_env_defaults(p, {"SPLITSERVE_PREFILL_WORKERS": "3", "SPLITSERVE_KV_TRANSPORT": "torch",
                           "SPLITSERVE_ADMISSION_CONTROL": "false", "SPLITSERVE_COLOCATED": "yes",
                           "SPLITSERVE_QUEUE_TIMEOUT": "2.5", "SPLITSERVE_UNRELATED": "x"})
    args = p.parse_args([])
    assert (args.prefill_workers, args.kv_transport, args.admission_control, args.colocated, args.queue_timeout) == \
        (3, "torch", False, True, 2.5)
    args = p.parse_args(["--prefill-workers", "5", "--admission-control"])
    assert (args.prefill_workers, args.admission_control) == (5, True)


def test_a_repeatable_flag_takes_the_variable_as_one_value() -> None:
    # `--api-key` from $SPLITSERVE_API_KEY: one key, not one key per character
    p = argparse.ArgumentParser()
    p.add_argument("--api-key", action="append", default=None)
    apply_env_defaults(p, {"SPLITSERVE_API_KEY": "sk-test"})
    assert p.parse_args([]).api_key == ["sk-test"]


def test_a_flag_of_several_values_takes_the_variables_words() -> None:
    # `--served-model-name a b` from $SPLITSERVE_SERVED_MODEL_NAME="a b", each word checked as the flag's values are
    p = argparse.ArgumentParser()
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--sizes", nargs="+", type=int, default=None)
    apply_env_defaults(p, {"SPLITSERVE_SERVED_MODEL_NAME": "llama-3 my-alias", "SPLITSERVE_SIZES": "1 2"})
    args = p.parse_args([])
    assert (args.served_model_name, args.sizes) == (["llama-3", "my-alias"], [1, 2])
    with pytest.raises(ValueError, match=r"\$SPLITSERVE_SIZES"):
        apply_env_defaults(p, {"SPLITSERVE_SIZES": "1 two"})


def test_an_empty_variable_is_unset() -> None:
    p = _parser()
    apply_env_defaults(p, {"SPLITSERVE_PREFILL_WORKERS": ""})
    assert p.parse_args([]).prefill_workers is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPLITSERVE_PREFILL_WORKERS": "three"}, "$SPLITSERVE_PREFILL_WORKERS"),
        ({"SPLITSERVE_KV_TRANSPORT": "pigeon"}, "$SPLITSERVE_KV_TRANSPORT must be one of grpc, torch"),
        ({"SPLITSERVE_ADMISSION_CONTROL": "maybe"}, "$SPLITSERVE_ADMISSION_CONTROL must be one of"),
    ],
)
def test_a_bad_value_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("$", r"\$")):
        apply_env_defaults(_parser(), env)


def test_the_commands_read_them(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPLITSERVE_DECODE_WORKERS", "4")
    monkeypatch.setenv("SPLITSERVE_PORT", "9001")
    assert cli.build_parser().parse_args(["head"]).decode_workers == 4
    assert cli.build_parser().parse_args(["gateway"]).port == 9001
    monkeypatch.setenv("SPLITSERVE_PORT", "http")
    assert cli.main(["gateway"]) == 2
    assert "splitserve: error: $SPLITSERVE_PORT" in capsys.readouterr().err


def test_the_head_needs_a_shared_redis_or_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["head", "--ray-address", "127.0.0.1:1"]) == 2
    assert "--redis-url" in capsys.readouterr().err
    assert cli.main(["head", "--no-prefix-index", "--start-ray", "ray stop"]) == 2
    assert "must be a `ray start ...` command" in capsys.readouterr().err
