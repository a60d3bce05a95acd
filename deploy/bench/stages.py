"""The gateway's TTFT breakdown, `splitserve:ttft_stage_seconds{stage}` (router/metrics.py), over one bench run:
the histogram scraped from /metrics before and after, and the delta's count, mean and quantiles per stage.

A quantile comes from the delta's buckets as Prometheus' histogram_quantile computes it: the bucket where the
rank falls, linearly interpolated between its bounds (0 below the first); a rank past the last finite bound
gives that bound. A server without the metric (any other OpenAI server) gives no histograms, and no stages.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from dataclasses import dataclass

STAGE_METRIC = "splitserve:ttft_stage_seconds"


@dataclass(frozen=True)
class Histogram:
    """One label set's cumulative histogram: (upper bound, cumulative count) ascending, +Inf last."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum_s: float

    def minus(self, before: Histogram) -> Histogram:
        """This histogram less an earlier scrape of the same series; a ValueError when it is not a later scrape of
        the same process (other bounds, or a count that went down: the server restarted in between)."""
        if [le for le, _ in self.buckets] != [le for le, _ in before.buckets]:
            raise ValueError("the histogram's buckets changed between the scrapes (the server restarted?)")
        if self.count < before.count:
            raise ValueError("the histogram's count went down between the scrapes (the server restarted?)")
        return Histogram(buckets=tuple((le, a - b) for (le, a), (_, b) in zip(self.buckets, before.buckets)),
                         count=self.count - before.count, sum_s=self.sum_s - before.sum_s)

    def quantile(self, q: float) -> float | None:
        """histogram_quantile(q) of this histogram; None when it counts nothing."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower  # past the last finite bound: that bound, as Prometheus answers
                in_bucket = cumulative - below
                return lower + (le - lower) * ((rank - below) / in_bucket if in_bucket > 0 else 0.0)
            lower, below = le, cumulative
        return lower


def parse_stage_histograms(text: str) -> dict[str, Histogram]:
    """stage -> its histogram, from a Prometheus text exposition; {} when the metric is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, list[tuple[float, float]]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != STAGE_METRIC:
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage is None:
                continue
            if sample.name == f"{STAGE_METRIC}_bucket":
                buckets.setdefault(stage, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name == f"{STAGE_METRIC}_count":
                counts[stage] = sample.value
            elif sample.name == f"{STAGE_METRIC}_sum":
                sums[stage] = sample.value
    return {stage: Histogram(buckets=tuple(sorted(b)), count=counts.get(stage, 0.0), sum_s=sums.get(stage, 0.0))
            for stage, b in buckets.items()}


def scrape(url: str, *, timeout_s: float = 10.0) -> dict[str, Histogram]:
    """The stage histograms at `url`/metrics; {} when the server has no /metrics or not this metric."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout_s) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return {}
    try:
        return parse_stage_histograms(text)
    except ValueError:  # not a Prometheus exposition
        return {}


def stage_deltas(before: dict[str, Histogram], after: dict[str, Histogram]) -> dict[str, dict[str, float | None]]:
    """Per stage seen in both scrapes: the requests it timed in between, their total, mean, p50 and p90 seconds.
    Stages that timed nothing in between (kv_transfer on a colocated server) have count 0 and no statistics."""
    out: dict[str, dict[str, float | None]] = {}
    for stage, end in after.items():
        if stage not in before:
            continue
        delta = end.minus(before[stage])
        out[stage] = {"count": delta.count, "sum_s": delta.sum_s,
                      "mean_s": delta.sum_s / delta.count if delta.count > 0 else None,
                      "p50_s": delta.quantile(0.5), "p90_s": delta.quantile(0.9)}
    return out
