"""report.html: one self-contained page (inline style, no script, the PNGs by relative name beside it) whose
tables hold report.json's numbers. Every number cell carries `data-key`, its path in report.json
("runs.0.ttft_s.p90"), and shows the value to 6 significant digits; a missing value shows as "-".
"""

from __future__ import annotations

import html
import json
from typing import Any

from deploy.bench.plots import load_label, load_value

# The runs' two tables: (id, title, columns as (path in a run, heading)).
RUN_TABLES: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("throughput", "Throughput", (
        ("num_requests", "requests"), ("num_errors", "errors"), ("throughput_rps", "throughput req/s"),
        ("goodput_rps", "goodput req/s"), ("output_tokens_per_s", "output tok/s"),
        ("input_tokens_per_s", "input tok/s"), ("concurrency_mean", "in flight (mean)"), ("isl_mean", "ISL"),
        ("osl_mean", "OSL"), ("duration_s", "duration s"))),
    ("latency", "Latency (seconds)", (
        ("ttft_s.p50", "TTFT p50"), ("ttft_s.p90", "TTFT p90"), ("ttft_s.p99", "TTFT p99"),
        ("tpot_s.p50", "TPOT p50"), ("tpot_s.p90", "TPOT p90"), ("itl_s.p50", "ITL p50"), ("itl_s.p90", "ITL p90"),
        ("itl_s.p99", "ITL p99"), ("latency_s.p50", "latency p50"), ("latency_s.p90", "latency p90"))),
)
STAGE_COLUMNS = ("count", "mean_s", "p50_s", "p90_s")
STYLE = """body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}th{background:#f2f2f2}
td.l,th.l{text-align:left}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}code{font-size:12px}"""


def _get(data: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _num(value: Any, key: str) -> str:
    text = "-" if value is None else f"{value:.6g}"
    return f'<td data-key="{html.escape(key)}">{text}</td>'


def render(report: dict[str, Any], images: list[str]) -> str:
    """The page for `report` (report.json's dict) showing `images` (file names in the same directory)."""
    e = html.escape
    slo = report["slo"]
    head = [("url", report["url"]), ("model", report["model"]), ("backend", report["backend"]),
            ("workload", json.dumps(report["workload"])),
            ("load", f"{report['load']['mode']}: {', '.join(f'{p:g}' for p in report['load']['points'])}"),
            ("SLO", "none" if slo["ttft_s"] is None and slo["tpot_s"] is None
             else f"TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s"),
            ("versions", ", ".join(f"{k} {v}" for k, v in report["versions"].items())),
            ("created", report["created"])]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>splitserve bench: {e(report['model'])}</title><style>{STYLE}</style></head><body>",
           f"<h1>splitserve bench: {e(report['model'])}</h1>", '<table id="summary">']
    out += [f'<tr><th class="l">{e(k)}</th><td class="l">{e(str(v))}</td></tr>' for k, v in head]
    out.append("</table>")
    mode = report["load"]["mode"]
    for table_id, title, columns in RUN_TABLES:
        out += [f"<h2>{e(title)}</h2>", f'<table id="{table_id}"><tr>',
                f'<th class="l">{e(load_label(report))}</th>' + "".join(f"<th>{e(t)}</th>" for _, t in columns)
                + "</tr>"]
        for i, run in enumerate(report["runs"]):
            cells = _num(load_value(report, run), f"runs.{i}.{mode}")
            cells += "".join(_num(_get(run, key), f"runs.{i}.{key}") for key, _ in columns)
            out.append(f"<tr>{cells}</tr>")
        out.append("</table>")
    out.append("<p>TPOT: AIPerf's inter_token_latency, (latency - TTFT) / (output tokens - 1) per request; ITL: "
               "its inter_chunk_latency, between streamed chunks.</p>")
    if any(run.get("stages") for run in report["runs"]):
        out += ["<h2>TTFT by stage</h2>",
                "<p>The gateway's <code>splitserve:ttft_stage_seconds</code> histograms, scraped before and after "
                "each run: the requests each stage timed in between, their mean, and p50/p90 interpolated in the "
                "histogram's buckets.</p>", '<table id="stages"><tr>',
                f'<th class="l">{e(load_label(report))}</th><th class="l">stage</th>'
                + "".join(f"<th>{c}</th>" for c in STAGE_COLUMNS) + "</tr>"]
        for i, run in enumerate(report["runs"]):
            for stage, stats in (run.get("stages") or {}).items():
                cells = _num(load_value(report, run), f"runs.{i}.{mode}")
                cells += f'<td class="l">{e(stage)}</td>'
                cells += "".join(_num(stats.get(c), f"runs.{i}.stages.{stage}.{c}") for c in STAGE_COLUMNS)
                out.append(f"<tr>{cells}</tr>")
        out.append("</table>")
    else:
        out.append("<p>No TTFT stages: the server exports no <code>splitserve:ttft_stage_seconds</code>.</p>")
    out.append("<h2>Plots</h2>")
    out += [f'<p><img src="{e(name)}" alt="{e(name)}"></p>' for name in images]
    out += ["<h2>AIPerf commands</h2>"]
    out += [f"<p><code>{e(' '.join(run['aiperf_command']))}</code></p>" for run in report["runs"]]
    out.append("</body></html>")
    return "\n".join(out)
