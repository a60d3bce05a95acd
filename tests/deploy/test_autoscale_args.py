"""`serve --autoscale` and its flags: validated with clear errors (exit 2), turned into the autoscaler's config."""

from __future__ import annotations

import pytest

from deploy import cli
from deploy.cli import build_parser
from deploy.serve_command import serve_config_from_args
from router.autoscale_policy import PoolBounds

SLOS = ["--autoscale", "--ttft-slo", "0.5", "--tpot-slo", "0.05"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-workers-max", "3"], "--prefill-workers-max applies only with --autoscale"),
        (["--ttft-slo", "1", "--decode-workers-min", "2"],
         "--decode-workers-min, --ttft-slo apply only with --autoscale"),
        (["--autoscale", "--tpot-slo", "0.1"], "--autoscale needs --ttft-slo (seconds)"),
        (["--autoscale", "--ttft-slo", "1"], "--autoscale needs --tpot-slo (seconds)"),
        ([*SLOS[:2], "0", *SLOS[3:]], "--ttft-slo must be positive, got 0.0"),
        ([*SLOS, "--colocated"], "--autoscale resizes the prefill and decode pools; it cannot go with --colocated"),
        ([*SLOS, "--prefill-workers-min", "0"], "--prefill-workers-min must be at least 1, got 0"),
        ([*SLOS, "--decode-workers-min", "3", "--decode-workers-max", "2"],
         "--decode-workers-max (2) must be >= --decode-workers-min (3)"),
        ([*SLOS, "--prefill-workers", "4", "--prefill-workers-max", "3"],
         "--prefill-workers 4 is outside --prefill-workers-min/max 1..3"),
        ([*SLOS, "--scale-down-cooldown", "-1"], "--scale-down-cooldown must be >= 0, got -1.0"),
        ([*SLOS, "--autoscale-interval", "0"], "--autoscale-interval must be positive, got 0.0"),
        (["--autoscale-window", "0"], "--autoscale-window must be positive, got 0.0"),
    ],
)
def test_bad_autoscale_flags_exit_2_with_a_clear_message(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve: error: ") and message in err, err


def test_autoscale_flags_make_the_policy_and_start_each_pool_at_its_minimum() -> None:
    flags = ["serve", *SLOS, "--prefill-workers-min", "2", "--prefill-workers-max", "4", "--decode-workers-max", "3",
             "--scale-up-cooldown", "5", "--scale-down-cooldown", "50", "--autoscale-interval", "2",
             "--autoscale-window", "30", "--num-threads", "1"]
    config = serve_config_from_args(build_parser().parse_args(flags))
    assert config.gateway.autoscaler is not None and config.gateway.signal_window_s == 30.0
    policy = config.gateway.autoscaler.policy
    assert (policy.prefill, policy.decode) == (PoolBounds(min_workers=2, max_workers=4),
                                               PoolBounds(min_workers=1, max_workers=3))
    assert (policy.ttft_slo_s, policy.tpot_slo_s, policy.scale_up_cooldown_s, policy.scale_down_cooldown_s) == (
        0.5, 0.05, 5.0, 50.0)
    assert config.gateway.autoscaler.interval_s == 2.0
    assert (config.controller.num_prefill_workers, config.controller.num_decode_workers) == (2, 1)


def test_without_autoscale_the_pools_keep_their_flags_and_no_autoscaler_runs() -> None:
    config = serve_config_from_args(build_parser().parse_args(["serve", "--prefill-workers", "2"]))
    assert config.gateway.autoscaler is None and config.gateway.signal_window_s == 60.0
    assert config.controller.num_prefill_workers == 2


def test_autoscale_defaults_keep_the_starting_sizes_as_the_maximum() -> None:
    config = serve_config_from_args(build_parser().parse_args(["serve", *SLOS, "--decode-workers", "2"]))
    assert config.gateway.autoscaler is not None
    policy = config.gateway.autoscaler.policy
    assert (policy.prefill, policy.decode) == (PoolBounds(min_workers=1, max_workers=1),
                                               PoolBounds(min_workers=1, max_workers=2))
    assert (policy.scale_up_cooldown_s, policy.scale_down_cooldown_s, config.gateway.autoscaler.interval_s) == (
        30.0, 120.0, 5.0)
