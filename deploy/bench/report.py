"""report.json (schema "splitserve-bench/1", the one `splitserve plan --validate` reads: deploy/planner/validate.py)
from AIPerf's summaries, one run per load point.

    {"schema": "splitserve-bench/1", "created": ISO time, "url", "model", "backend": "aiperf",
     "versions": {"splitserve", "aiperf", "python"},
     "workload": {"kind", "isl", "osl", ...},            workload.py's Workload
     "load": {"mode": "rate" | "concurrency", "points": [...]},
     "slo": {"ttft_s", "tpot_s"} (null where not given),
     "stage_metric": "splitserve:ttft_stage_seconds",
     "runs": [{"rate": 2.0 | null,                 requests/s offered (Poisson); null in concurrency mode
               "concurrency": 4 | null,            requests kept in flight; null in rate mode
               "num_requests": 40,                 requests that completed
               "num_errors": 0,
               "duration_s",
               "ttft_s":  {"avg", "p50", "p90", "p99"},    seconds; validate.py reads p50 and p90
               "tpot_s":  {...},                   AIPerf's inter_token_latency: (latency - TTFT) / (tokens - 1)
               "itl_s":   {...},                   AIPerf's inter_chunk_latency: between streamed chunks
               "latency_s": {...},                 request latency, end to end
               "throughput_rps", "output_tokens_per_s", "input_tokens_per_s",
               "goodput_rps": 1.9 | null,          requests/s within both SLOs (null without an SLO)
               "concurrency_mean",                 requests in flight, AIPerf's time average
               "isl_mean", "osl_mean",             tokens per request, as the server counted them
               "seed", "aiperf_command",
               "client_cores": 0.06,               the cores AIPerf's processes kept busy over its requests
                                                   (client_cpu.py: what `plan --validate` prices, --one-host)
               "stages": {"prefill": {"count", "sum_s", "mean_s", "p50_s", "p90_s"}, ...}   only where the
                                                   server exports the stage metric (stages.py)
              }]}

A metric AIPerf did not report is null. Pure: dicts in, dicts out.
"""

from __future__ import annotations

import platform
from typing import Any

SCHEMA = "splitserve-bench/1"
QUANTILES = ("avg", "p50", "p90", "p99")


def _stat(summary: dict[str, Any], name: str, stat: str = "avg") -> float | None:
    value = (summary.get(name) or {}).get(stat)
    return None if value is None else float(value)


def _seconds(summary: dict[str, Any], name: str) -> dict[str, float | None]:
    """An AIPerf latency metric's statistics in seconds (AIPerf reports them in ms)."""
    unit = (summary.get(name) or {}).get("unit", "ms")
    scale = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "us": 1e-6, "ns": 1e-9}.get(unit)
    if scale is None:
        raise ValueError(f"AIPerf's {name} is in {unit!r}, not a unit of time")
    return {q: None if (v := _stat(summary, name, q)) is None else v * scale for q in QUANTILES}


def run_from_summary(summary: dict[str, Any], *, mode: str, point: float, seed: int,
                     command: list[str], stages: dict[str, dict[str, float | None]] | None) -> dict[str, Any]:
    """One run of report.json from AIPerf's profile_export_aiperf.json at one load point (mode "rate": requests/s;
    "concurrency": requests in flight). ValueError for a summary without TTFT (not a streamed run)."""
    if mode not in ("rate", "concurrency"):
        raise ValueError(f"load mode: rate or concurrency, got {mode!r}")
    if _stat(summary, "time_to_first_token", "p50") is None:
        raise ValueError("AIPerf's summary has no time_to_first_token (was the run streamed? did every request "
                         f"fail? errors: {summary.get('error_summary')})")
    completed = _stat(summary, "request_count")
    errors = sum(int(e.get("count", 0)) for e in summary.get("error_summary") or [])
    run: dict[str, Any] = {
        "rate": float(point) if mode == "rate" else None,
        "concurrency": int(point) if mode == "concurrency" else None,
        "num_requests": int(completed or 0),
        "num_errors": errors,
        "duration_s": _stat(summary, "benchmark_duration"),
        "ttft_s": _seconds(summary, "time_to_first_token"),
        "tpot_s": _seconds(summary, "inter_token_latency"),
        "itl_s": _seconds(summary, "inter_chunk_latency"),
        "latency_s": _seconds(summary, "request_latency"),
        "throughput_rps": _stat(summary, "request_throughput"),
        "output_tokens_per_s": _stat(summary, "output_token_throughput"),
        "input_tokens_per_s": _stat(summary, "input_token_throughput"),
        "goodput_rps": _stat(summary, "goodput"),
        "concurrency_mean": _stat(summary, "effective_concurrency"),
        "isl_mean": _stat(summary, "input_sequence_length"),
        "osl_mean": _stat(summary, "output_sequence_length"),
        "seed": seed,
        "aiperf_command": command,
    }
    if stages:
        run["stages"] = stages
    return run


def new_report(*, created: str, url: str, model: str, workload: dict[str, Any], mode: str, points: list[float],
               slo: dict[str, float | None], splitserve_version: str) -> dict[str, Any]:
    """report.json's header, with no runs yet (the command appends them as the sweep goes)."""
    return {"schema": SCHEMA, "created": created, "url": url, "model": model, "backend": "aiperf",
            "versions": {"splitserve": splitserve_version, "aiperf": None, "python": platform.python_version()},
            "workload": workload, "load": {"mode": mode, "points": points}, "slo": slo,
            "stage_metric": "splitserve:ttft_stage_seconds", "runs": []}


def add_run(report: dict[str, Any], run: dict[str, Any], summary: dict[str, Any]) -> None:
    report["runs"].append(run)
    report["versions"]["aiperf"] = summary.get("aiperf_version")
