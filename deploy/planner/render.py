"""A plan as people and tools read it: the ranked table, the best layout as `splitserve serve` flags and as the
Helm chart's values, and the JSON `--json` prints. Pure: strings and dicts, no I/O."""

from __future__ import annotations

import math
import shlex
from typing import Any

from deploy.planner.planner import Layout, Plan, Prediction
from deploy.planner.profile import Profile

# Engine flags a profile records that `serve` should run with too, when they differ from the engine's defaults.
_ENGINE_FLAGS = {"dtype": ("--dtype", "auto"), "kv_cache_dtype": ("--kv-cache-dtype", "auto"),
                 "quantization": ("--quantization", "none"), "block_size": ("--block-size", 16),
                 "load_format": ("--load-format", "auto")}


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:.0f}"


def format_table(plan: Plan, *, top: int = 10) -> str:
    """The ranked layouts, `top` of them: layout, workers, TTFT and TPOT p50/p90 (ms), goodput, for a finite run
    the requests refused, and whether it meets the SLO (else what binds)."""
    with_max = plan.traffic.rate is None
    finite = plan.traffic.num_requests is not None  # a finite run: the requests the gateway refuses, too
    # With tensor-parallel layouts the count is ranks (a worker of size N is N), what the plan ranks by.
    ranks = any(p.layout.num_ranks != p.layout.num_workers for p in plan.ranked)
    header = f"{'#':>2}  {'layout':34s} {'ranks' if ranks else 'workers':>7}  {'TTFT p50':>8} {'p90':>6}  " \
             f"{'TPOT p50':>8} {'p90':>6}  " \
             f"{'goodput':>8}  " + ("refused  " if finite else "") + ("max rate  " if with_max else "") + "SLO"
    lines = [header, "-" * len(header)]
    for i, p in enumerate(plan.ranked[:top], 1):
        rate = f"{p.max_rate:8.2f}  " if with_max and p.max_rate is not None else ("       -  " if with_max else "")
        refused = f"{p.num_refused:7.1f}  " if finite else ""
        count = p.layout.num_ranks if ranks else p.layout.num_workers
        lines.append(f"{i:>2}  {p.layout.label:34s} {count:>7}  {_ms(p.ttft_p50_s):>8} "
                     f"{_ms(p.ttft_p90_s):>6}  {_ms(p.tpot_p50_s):>8} {_ms(p.tpot_p90_s):>6}  {p.goodput:8.2f}  "
                     f"{refused}{rate}{'meets' if p.meets else 'misses: ' + p.binding}")
    return "\n".join(lines)


def serve_flags(profile: Profile, layout: Layout) -> list[str]:
    """`splitserve serve`'s arguments for `layout` (deploy/serve_args.py's and the engine's flag names)."""
    args = ["--model", profile.model.name]
    if layout.colocated:
        args += ["--colocated-workers", str(layout.num_colocated)]
        if layout.tp > 1:
            args += ["--tensor-parallel-size", str(layout.tp)]
    else:
        args += ["--prefill-workers", str(layout.num_prefill), "--decode-workers", str(layout.num_decode)]
        if layout.transport:
            args += ["--kv-transport", layout.transport]
        args += ["--disagg-prefill-threshold", str(layout.prefill_threshold_tokens)]
        for flag, tp in (("--prefill-tensor-parallel-size", layout.prefill_tp),
                         ("--decode-tensor-parallel-size", layout.decode_tp)):
            if tp > 1:
                args += [flag, str(tp)]
    return args + ["--max-num-seqs", str(layout.max_num_seqs), *_engine_args(profile)]


def _engine_args(profile: Profile) -> list[str]:
    """The profiled engine flags that differ from the defaults (a dtype `auto` resolves to on that device aside)."""
    auto_dtype = "float32" if str(profile.engine.get("device", "cpu")).startswith("cpu") else "bfloat16"
    args = []
    for field, (flag, default) in _ENGINE_FLAGS.items():
        value = profile.engine.get(field)
        if value is not None and value != default and not (field == "dtype" and value == auto_dtype):
            args += [flag, str(value)]
    return args


def helm_values(profile: Profile, plan: Plan) -> tuple[dict[str, Any], str]:
    """The chart's values (helm/splitserve/values.yaml's names) for the best disaggregated layout, and a note: the
    chart runs disaggregated pools only, so a colocated best is said so in the note and left out."""
    disaggregated = [p for p in plan.ranked if not p.layout.colocated]
    if not disaggregated:
        return {}, "no disaggregated layout was priced (the profile measured no KV handoff)"
    chosen = next((p for p in disaggregated if p.meets), disaggregated[0])
    note = ""
    if plan.best.layout.colocated:
        note = (f"the best layout is colocated ({plan.best.layout.label}), which the chart does not run; these values "
                f"are the best disaggregated one ({chosen.layout.label})")
    layout = chosen.layout
    engine = ["--max-num-seqs", str(layout.max_num_seqs), *_engine_args(profile)]
    values = {
        "model": profile.model.name,
        "kvTransport": layout.transport or "grpc",
        "engine": engine,
        "gateway": {"args": ["--disagg-prefill-threshold", str(layout.prefill_threshold_tokens)]},
        "prefill": {"replicas": layout.num_prefill, "workersPerNode": 1, "tensorParallelSize": layout.prefill_tp},
        "decode": {"replicas": layout.num_decode, "workersPerNode": 1, "tensorParallelSize": layout.decode_tp},
    }
    return values, note


def to_yaml(values: dict[str, Any], indent: int = 0) -> str:
    """A small YAML writer for the values above (dicts, lists of scalars, scalars): no PyYAML needed."""
    lines = []
    pad = "  " * indent
    for key, value in values.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 1))
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [{', '.join(_scalar(v) for v in value)}]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "\n".join(lines)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def plan_json(profile: Profile, plan: Plan, *, top: int | None = None) -> dict[str, Any]:
    """`plan --json`: the traffic, the SLO, the profile it used, the ranked layouts and the recommendation."""
    ranked: list[Prediction] = list(plan.ranked if top is None else plan.ranked[:top])
    best = plan.best
    return {
        "schema": "splitserve-plan/1",
        "profile": {"model": profile.model.name, "identity": profile.model.identity, "created": profile.created,
                    "device": profile.machine.get("device")},
        "traffic": {"isl": plan.traffic.isl, "osl": plan.traffic.osl, "prefix_hit": plan.traffic.prefix_hit,
                    "rate": plan.traffic.rate, "num_requests": plan.traffic.num_requests},
        "slo": {"ttft_s": plan.slo.ttft_s, "tpot_s": plan.slo.tpot_s},
        "met": plan.met,
        "problem": plan.problem,
        "best": {**best.to_json(), "serve_flags": serve_flags(profile, best.layout)},
        "ranked": [p.to_json() for p in ranked],
    }


def serve_command(profile: Profile, layout: Layout) -> str:
    return "splitserve serve " + shlex.join(serve_flags(profile, layout))
