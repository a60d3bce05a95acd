"""The report's PNGs, drawn with matplotlib (the `bench` extra: pip install 'splitserve[bench]'), Agg backend.

    throughput_latency.png   request latency p50/p90 against request throughput, one point per load
    ttft_itl.png             TTFT and ITL p50/p90/p99 against the load (rate or concurrency)
    goodput.png              goodput (requests/s within the SLOs) and throughput against the load; only with an SLO
    stages.png               the gateway's TTFT stages (mean seconds, stacked) per load point; only where the
                             server exports them

`draw(report, directory)` returns the files written, in that order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = "splitserve bench draws its plots with matplotlib: pip install 'splitserve[bench]' (or matplotlib)"


def require_matplotlib() -> None:
    """ImportError's clear form, raised before a sweep starts rather than after it ran."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_label(report: dict[str, Any]) -> str:
    return "offered rate (requests/s)" if report["load"]["mode"] == "rate" else "concurrency (requests in flight)"


def load_value(report: dict[str, Any], run: dict[str, Any]) -> float:
    return run["rate"] if report["load"]["mode"] == "rate" else run["concurrency"]


def _series(runs: list[dict[str, Any]], metric: str, stat: str) -> list[float]:
    return [float("nan") if (v := r[metric].get(stat)) is None else v for r in runs]


def draw(report: dict[str, Any], directory: Path) -> list[str]:
    plt = _pyplot()
    runs = report["runs"]
    if not runs:
        return []
    x = [load_value(report, r) for r in runs]
    files: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(directory / name, dpi=100)
        plt.close(fig)
        files.append(name)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    throughput = [r["throughput_rps"] or 0.0 for r in runs]
    for stat, style in (("p50", "o-"), ("p90", "s--")):
        ax.plot(throughput, _series(runs, "latency_s", stat), style, label=f"latency {stat}")
    for t, y, v in zip(throughput, _series(runs, "latency_s", "p90"), x):
        ax.annotate(f"{v:g}", (t, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="throughput (requests/s)", ylabel="request latency (s)",
           title="throughput against latency (points labelled by load)")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "throughput_latency.png")

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((left, "ttft_s", "time to first token"), (right, "itl_s", "inter-token latency")):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, _series(runs, metric, stat), style, label=stat)
        ax.set(xlabel=load_label(report), ylabel="seconds", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "ttft_itl.png")

    if any(r.get("goodput_rps") is not None for r in runs):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.plot(x, throughput, "s-", color="tab:orange", linewidth=4, alpha=0.4, label="throughput")
        ax.plot(x, [r["goodput_rps"] or 0.0 for r in runs], "o--", color="tab:blue", label="goodput (within the SLO)")
        if report["load"]["mode"] == "rate":
            ax.plot(x, x, ":", color="grey", label="offered")
        slo = report["slo"]
        ax.set(xlabel=load_label(report), ylabel="requests/s",
               title=f"goodput at TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "goodput.png")

    staged = [r for r in runs if r.get("stages")]
    if staged:
        stages = list(dict.fromkeys(s for r in staged for s in r["stages"]))
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        labels = [f"{load_value(report, r):g}" for r in staged]
        bottom = [0.0] * len(staged)
        for stage in stages:
            means = [(r["stages"].get(stage) or {}).get("mean_s") or 0.0 for r in staged]
            ax.bar(labels, means, bottom=bottom, label=stage)
            bottom = [b + m for b, m in zip(bottom, means)]
        ax.plot(labels, [r["ttft_s"]["avg"] or 0.0 for r in staged], "kD", label="TTFT mean (client, AIPerf)")
        ax.set(xlabel=load_label(report), ylabel="mean seconds per request",
               title="TTFT by stage (the gateway's ttft_stage_seconds)")
        ax.legend(fontsize=8)
        save(fig, "stages.png")
    return files
