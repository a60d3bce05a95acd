"""`splitserve plan --validate DIR`: a bench run of a planned layout against the plan's prediction, metric by
metric. Pure but for reading the two files.

DIR holds two files:

    plan.json     what `splitserve plan ... --json` printed (schema "splitserve-plan/1"): its `best` layout and
                  its traffic are what is checked
    report.json   the measured runs (schema "splitserve-bench/1", as `splitserve bench` writes it with more fields
                  than these, which are ignored: deploy/bench/report.py), one per rate of a sweep:

        {"schema": "splitserve-bench/1",
         "layout": {...}                      optional: a layout as plan.json writes one; default plan.json's best
         "runs": [{"rate": 2.0,               requests/s offered (Poisson); a run without a rate is not compared
                   "num_requests": 200,
                   "ttft_s": {"p50": 0.41, "p90": 0.77},
                   "tpot_s": {"p50": 0.052, "p90": 0.061},
                   "goodput_rps": 1.9}]}      optional: requests/s meeting both SLOs

For each run the layout is priced at the run's rate from the profile and each metric is compared: predicted,
measured, predicted / measured - 1. The highest sustainable rate is compared with the highest run rate whose
TTFT p90 and TPOT p90 met the plan's SLO (a lower bound, as good as the sweep's spacing).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.planner.planner import SLO, Layout, PlanOptions, Traffic, LayoutModel
from deploy.planner.profile import Profile

REPORT_SCHEMA = "splitserve-bench/1"
PLAN_SCHEMA = "splitserve-plan/1"
METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "goodput")


@dataclass(frozen=True)
class Comparison:
    rate: float
    metric: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """predicted / measured - 1 (inf where the measurement is 0)."""
        return math.inf if self.measured == 0 else self.predicted / self.measured - 1


def _read(path: Path, schema: str) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        raise ValueError(f"{path}: expected schema {schema!r}")
    return data


def _layout(values: dict[str, Any]) -> Layout:
    names = ("num_colocated", "num_prefill", "num_decode", "max_num_seqs", "prefill_threshold_tokens", "transport")
    return Layout(**{name: values[name] for name in names if name in values})


def compare_run_dir(profile: Profile, directory: str | Path, options: PlanOptions) -> tuple[list[Comparison],
                                                                                           dict[str, Any]]:
    """The comparisons of every run in DIR/report.json with the plan's prediction (see the module docstring), and
    a summary: the layout, the predicted and the measured highest rates. ValueError for files that do not fit."""
    directory = Path(directory)
    planned = _read(directory / "plan.json", PLAN_SCHEMA)
    report = _read(directory / "report.json", REPORT_SCHEMA)
    if planned["profile"]["identity"] != profile.model.identity:
        raise ValueError(f"{directory / 'plan.json'} was planned on a profile of {planned['profile']['model']} "
                         f"({planned['profile']['identity']}), not this profile's {profile.model.name} "
                         f"({profile.model.identity})")
    t, s = planned["traffic"], planned["slo"]
    slo = SLO(ttft_s=s["ttft_s"], tpot_s=s["tpot_s"])
    traffic = Traffic(isl=t["isl"], osl=t["osl"], prefix_hit=t["prefix_hit"])
    layout = _layout(report.get("layout") or planned["best"]["layout"])
    model = LayoutModel(profile, traffic, layout, options)
    comparisons: list[Comparison] = []
    sustained = []
    for i, run in enumerate(report.get("runs", [])):
        rate = run.get("rate")
        if rate is None:
            continue
        try:
            measured = {"ttft_p50_s": run["ttft_s"]["p50"], "ttft_p90_s": run["ttft_s"]["p90"],
                        "tpot_p50_s": run["tpot_s"]["p50"], "tpot_p90_s": run["tpot_s"]["p90"]}
        except (KeyError, TypeError):
            raise ValueError(f"{directory / 'report.json'}: runs[{i}] needs ttft_s and tpot_s with p50 and "
                             "p90") from None
        if run.get("goodput_rps") is not None:
            measured["goodput"] = run["goodput_rps"]
        predicted = model.predict(float(rate), slo)
        for metric, value in measured.items():
            comparisons.append(Comparison(rate=float(rate), metric=metric, predicted=getattr(predicted, metric),
                                          measured=float(value)))
        if measured["ttft_p90_s"] <= slo.ttft_s and measured["tpot_p90_s"] <= slo.tpot_s:
            sustained.append(float(rate))
    best = model.max_rate(slo)
    summary = {"layout": layout.label, "predicted_max_rate": None if best is None else best.max_rate,
               "measured_max_rate": max(sustained) if sustained else None}
    return comparisons, summary


def format_comparisons(comparisons: list[Comparison], summary: dict[str, Any]) -> str:
    lines = [f"layout {summary['layout']}",
             f"{'rate':>6}  {'metric':12s} {'predicted':>10} {'measured':>10} {'error':>8}"]
    for c in comparisons:
        error = "inf" if math.isinf(c.error) else f"{c.error * 100:+.0f}%"
        lines.append(f"{c.rate:6.2f}  {c.metric:12s} {c.predicted:10.4f} {c.measured:10.4f} {error:>8}")
    predicted, measured = summary["predicted_max_rate"], summary["measured_max_rate"]
    lines.append(f"highest rate within the SLO: predicted {'none' if predicted is None else f'{predicted:.2f}'}, "
                 f"measured {'none' if measured is None else f'{measured:.2f} (the highest run rate that met it)'}")
    return "\n".join(lines)
