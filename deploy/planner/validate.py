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
                   "num_requests": 200,           completed (AIPerf's request_count)
                   "num_errors": 3,               optional: failed, here refused by the gateway (429/503)
                   "num_requests_sent": 203,      optional: sent (default num_requests + num_errors)
                   "ttft_s": {"p50": 0.41, "p90": 0.77},
                   "tpot_s": {"p50": 0.052, "p90": 0.061},
                   "goodput_rps": 1.9,        optional: requests/s meeting both SLOs
                   "client_cores": 0.06,      optional: the cores the load generator kept busy over its requests
                                              (deploy/bench/client_cpu.py)
                   "stages": {"prefill": {"count": 200, "mean_s": 0.47}, ...}}]}
                                              optional: our ttft_stage_seconds histograms over the run (stages.py)

For each run the layout is priced at the run's rate as a finite run of the requests it sent (finite_run.py:
past capacity a run of N has a finite backlog, and the gateway refuses what its queue cannot hold), and each
metric is compared: predicted, measured, predicted / measured - 1; the steady-state prediction rides along for
reference (inf where the pools cannot keep up). Refusals compare the predicted mean count with the run's errors
(their error is the difference, predicted - measured, not a ratio). Where the run holds our TTFT stage
histograms, each simulated stage's mean is compared too (router_queue_s, prefill_queue_s, prefill_s,
kv_transfer_s: where a TTFT misses, which part of it). The highest sustainable rate is compared with
the highest run rate whose TTFT p90 and TPOT p90 met the plan's SLO with nothing refused (a lower bound, as good
as the sweep's spacing); predicted for a run of the first run's length, and in steady state.

The load generator's CPU (`--one-host`): with `measured_client` (`plan --validate` without --client-cores), each
run is priced with the cores its own load generator measured (its `client_cores`; a run without one, at their
mean), and the highest rate with their mean: the check then asks whether the model is right about the host the
runs had, not whether a guess about the client was. Otherwise the options' --client-cores prices every run.
"""

from __future__ import annotations

import dataclasses
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
    predicted: float  # a finite run of the run's requests
    measured: float
    steady: float = math.nan  # the steady-state prediction (inf: the pools cannot keep up)
    num_requests: int | None = None  # the run's requests sent

    @property
    def error(self) -> float:
        """predicted / measured - 1 (inf where the measurement is 0); for "refused", predicted - measured."""
        if self.metric == "refused":
            return self.predicted - self.measured
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


def _layout(values: dict[str, Any], profile: Profile) -> Layout:
    names = ("num_colocated", "num_prefill", "num_decode", "max_num_seqs", "prefill_threshold_tokens", "transport",
             "tp", "prefill_tp", "decode_tp")
    layout = Layout(**{name: values[name] for name in names if name in values})
    unmeasured = {layout.tp, layout.prefill_tp, layout.decode_tp} - set(profile.tensor_parallel_sizes)
    if unmeasured:
        raise ValueError(f"the planned layout {layout.label} runs tensor-parallel size(s) {sorted(unmeasured)}, "
                         f"which this profile did not measure ({', '.join(map(str, profile.tensor_parallel_sizes))})")
    return layout


def compare_run_dir(profile: Profile, directory: str | Path, options: PlanOptions, *,
                    measured_client: bool = False) -> tuple[list[Comparison], dict[str, Any]]:
    """The comparisons of every run in DIR/report.json with the plan's prediction (see the module docstring), and
    a summary: the layout, the client cores priced, the predicted and the measured highest rates. ValueError for
    files that do not fit."""
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
    layout = _layout(report.get("layout") or planned["best"]["layout"], profile)
    runs_client = [_client_cores(run, i, directory) for i, run in enumerate(report.get("runs", []))]
    measured_cores = [c for c in runs_client if c is not None] if measured_client and options.one_host else []
    if measured_cores:
        options = dataclasses.replace(options, client_cores=sum(measured_cores) / len(measured_cores))
    model = LayoutModel(profile, traffic, layout, options)
    comparisons: list[Comparison] = []
    sustained = []
    first_n: int | None = None
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
        num_errors = int(run.get("num_errors") or 0)
        measured["refused"] = num_errors
        num_sent = int(run.get("num_requests_sent") or (int(run.get("num_requests") or 0) + num_errors))
        first_n = first_n or num_sent or None
        at = model
        if measured_cores and runs_client[i] is not None:  # this run's own client
            at = LayoutModel(profile, traffic, layout, dataclasses.replace(options, client_cores=runs_client[i]))
        steady = at.predict_steady(float(rate), slo)
        predicted = at.predict_finite(float(rate), slo, num_sent) if num_sent else steady
        for metric, value in measured.items():
            guess = predicted.num_refused if metric == "refused" else getattr(predicted, metric)
            comparisons.append(Comparison(rate=float(rate), metric=metric, predicted=guess, measured=float(value),
                                          steady=0.0 if metric == "refused" else getattr(steady, metric),
                                          num_requests=num_sent or None))
        for stage, mean_s in _stage_means(run).items():  # where the run scraped our TTFT stage histograms
            if stage in predicted.stages:
                comparisons.append(Comparison(rate=float(rate), metric=f"{stage}_s", predicted=predicted.stages[stage],
                                              measured=mean_s, num_requests=num_sent or None))
        if measured["ttft_p90_s"] <= slo.ttft_s and measured["tpot_p90_s"] <= slo.tpot_s and not num_errors:
            sustained.append(float(rate))
    best_steady = model.max_rate(slo)
    best = best_steady
    if first_n is not None:
        best = LayoutModel(profile, dataclasses.replace(traffic, num_requests=first_n), layout, options).max_rate(slo)
    summary = {"layout": layout.label, "predicted_max_rate": None if best is None else best.max_rate,
               "client_cores": options.client_cores if options.one_host else None,
               "client_measured": bool(measured_cores),
               "num_requests": first_n,
               "steady_max_rate": None if best_steady is None else best_steady.max_rate,
               "measured_max_rate": max(sustained) if sustained else None}
    return comparisons, summary


def _client_cores(run: Any, i: int, directory: Path) -> float | None:
    value = run.get("client_cores") if isinstance(run, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{directory / 'report.json'}: runs[{i}].client_cores: expected cores >= 0, got {value!r}")
    return float(value)


def _stage_means(run: dict[str, Any]) -> dict[str, float]:
    """The run's mean seconds per TTFT stage (`stages`, as deploy/bench/stages.py writes them), where present."""
    out = {}
    for stage, stats in (run.get("stages") or {}).items():
        if isinstance(stats, dict) and isinstance(stats.get("mean_s"), (int, float)) and stats.get("count"):
            out[stage] = float(stats["mean_s"])
    return out


def format_comparisons(comparisons: list[Comparison], summary: dict[str, Any]) -> str:
    cores = summary.get("client_cores")
    client = "" if cores is None else (
        f", the load generator's CPU as each run measured it (mean {cores:.3f} cores)" if summary.get("client_measured")
        else f", the load generator at {cores:.2f} cores")
    lines = [f"layout {summary['layout']}{client}",
             f"{'rate':>6}  {'metric':18s} {'predicted':>10} {'measured':>10} {'error':>8}  {'steady state':>12}"]
    for c in comparisons:
        if c.metric == "refused":
            error = f"{c.error:+.1f}"
        else:
            error = "inf" if math.isinf(c.error) else f"{c.error * 100:+.0f}%"
        steady = "" if c.metric == "refused" or math.isnan(c.steady) else f"{c.steady:12.4f}"
        lines.append(f"{c.rate:6.2f}  {c.metric:18s} {c.predicted:10.4f} {c.measured:10.4f} {error:>8}  {steady}")
    predicted, measured = summary["predicted_max_rate"], summary["measured_max_rate"]
    steady = summary.get("steady_max_rate")
    of = f" (a run of {summary['num_requests']})" if summary.get("num_requests") else ""
    lines.append(f"highest rate within the SLO: predicted {'none' if predicted is None else f'{predicted:.2f}'}{of}, "
                 f"steady state {'none' if steady is None else f'{steady:.2f}'}, measured "
                 + ("none" if measured is None else f"{measured:.2f} (the highest run rate that met it, none refused)"))
    return "\n".join(lines)
