"""`serve`'s autoscaling flags (vLLM-style names where vLLM has one): the built-in autoscaler's bounds, SLOs and
cool-downs, validated into an `AutoscalerConfig` (router/autoscaler.py), and the signals' window (a field of the
gateway's config, `AUTOSCALE_WINDOW`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from deploy.config_flags import ConfigFlag, add_config_flags
from router.config import GatewayConfig

if TYPE_CHECKING:
    from router.autoscaler import AutoscalerConfig

# The gateway's signals' window: a GatewayConfig field (gateway_config_from_args takes it with `flags`).
AUTOSCALE_WINDOW = ConfigFlag("--autoscale-window", "signal_window_s",
                              "seconds of requests behind the TTFT/TPOT percentiles of the splitserve:pool_* "
                              "signals (with or without --autoscale)", type=float)


def add_autoscale_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("autoscaling (docs/autoscaling.md)")
    g.add_argument("--autoscale", action="store_true",
                   help="resize the prefill pool on TTFT and queue pressure and the decode pool on TPOT and KV "
                        "pressure, within the bounds below; each decision is logged with its reason")
    for pool in ("prefill", "decode"):
        g.add_argument(f"--{pool}-workers-min", type=int, default=None,
                       help=f"smallest {pool} pool under --autoscale (default 1)")
        g.add_argument(f"--{pool}-workers-max", type=int, default=None,
                       help=f"largest {pool} pool under --autoscale (default: its starting size)")
    g.add_argument("--ttft-slo", type=float, default=None,
                   help="seconds: the p90 time to first token the prefill pool is grown to keep (needed by "
                        "--autoscale)")
    g.add_argument("--tpot-slo", type=float, default=None,
                   help="seconds: the p90 time per output token the decode pool is grown to keep (needed by "
                        "--autoscale)")
    g.add_argument("--scale-up-cooldown", type=float, default=30.0,
                   help="seconds after a pool's resize before it may grow again")
    g.add_argument("--scale-down-cooldown", type=float, default=120.0,
                   help="seconds a pool must stay idle (and unresized) before it shrinks by one worker")
    g.add_argument("--autoscale-interval", type=float, default=5.0, help="seconds between autoscaling decisions")
    add_config_flags(g, GatewayConfig, (AUTOSCALE_WINDOW,))


def autoscaler_from_args(args: argparse.Namespace, num_prefill: int, num_decode: int,
                         colocated: bool) -> tuple[AutoscalerConfig | None, int, int]:
    """(the autoscaler's config or None, the starting prefill and decode sizes). Raises ValueError naming the
    bad flag. Under --autoscale a pool starts at its --*-workers flag, or at its minimum."""
    from router.autoscale_policy import AutoscalePolicy, PoolBounds  # the gateway's, loaded only when serving
    from router.autoscaler import AutoscalerConfig

    bound_flags = {f"--{pool}-workers-{end}": getattr(args, f"{pool}_workers_{end}")
                   for pool in ("prefill", "decode") for end in ("min", "max")}
    if not args.autoscale:
        given = [flag for flag, value in (*bound_flags.items(), ("--ttft-slo", args.ttft_slo),
                                          ("--tpot-slo", args.tpot_slo)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --autoscale")
        return None, num_prefill, num_decode
    if colocated:
        raise ValueError("--autoscale resizes the prefill and decode pools; it cannot go with --colocated")
    for flag in ("--ttft-slo", "--tpot-slo"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            raise ValueError(f"--autoscale needs {flag} (seconds)")
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag in ("--scale-up-cooldown", "--scale-down-cooldown"):
        if not getattr(args, flag[2:].replace("-", "_")) >= 0:
            raise ValueError(f"{flag} must be >= 0, got {getattr(args, flag[2:].replace('-', '_'))}")
    if not args.autoscale_interval > 0:
        raise ValueError(f"--autoscale-interval must be positive, got {args.autoscale_interval}")
    bounds, sizes = {}, {}
    for pool, given_size in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
        low, high = bound_flags[f"--{pool}-workers-min"], bound_flags[f"--{pool}-workers-max"]
        low = 1 if low is None else low
        if low < 1:
            raise ValueError(f"--{pool}-workers-min must be at least 1, got {low}")
        size = low if given_size is None else given_size
        high = max(size, low) if high is None else high
        if high < low:
            raise ValueError(f"--{pool}-workers-max ({high}) must be >= --{pool}-workers-min ({low})")
        if not low <= size <= high:
            raise ValueError(f"--{pool}-workers {size} is outside --{pool}-workers-min/max {low}..{high}")
        bounds[pool], sizes[pool] = PoolBounds(min_workers=low, max_workers=high), size
    policy = AutoscalePolicy(prefill=bounds["prefill"], decode=bounds["decode"], ttft_slo_s=args.ttft_slo,
                             tpot_slo_s=args.tpot_slo, scale_up_cooldown_s=args.scale_up_cooldown,
                             scale_down_cooldown_s=args.scale_down_cooldown)
    return AutoscalerConfig(policy=policy, interval_s=args.autoscale_interval), sizes["prefill"], sizes["decode"]
