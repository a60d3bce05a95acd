"""Per-pool autoscaling signals: what the built-in autoscaler decides on (router/autoscale_policy.py), and what
/metrics exposes for an external one (Kubernetes HPA through prometheus-adapter, KEDA's Prometheus scaler).

    per pool (label pool = prefill | decode | colocated), at scrape or decision time:
        num_workers                     workers of the pool the router knows (published by the controller)
        num_requests_waiting            Σ its workers' waiting requests (their engines' queues)
        num_requests_running            Σ its workers' running requests
        num_queued_prompt_tokens        Σ its workers' prompt tokens not yet computed (LoadStats)
        kv_cache_usage mean, max        over its workers that reported a load (0-1)
        num_gateway_queued              (the pool Generate goes to) requests in this gateway's admission queue
    per request, over a sliding window (`LatencyWindow`, the last `window_s` seconds of finished measurements):
        TTFT   arrival at the router -> first token: attributed to the prefill pool (colocated: its one pool)
        TPOT   (last token - first token) / (tokens - 1) of a request that streamed at least two tokens, recorded
               when it ends: attributed to the decode pool (colocated: its one pool)

Worker figures are the registry's latest loads (router/worker_registry.py): every gateway replica sees the same
workers, so with several replicas an external autoscaler takes max() of those, not sum(). The windows and the
gateway queue are this replica's own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from router.worker_registry import WorkerSnapshot

QUANTILES = (0.5, 0.9, 0.99)
TTFT_POOLS = ("prefill", "colocated")  # the pools TTFT is attributed to
TPOT_POOLS = ("decode", "colocated")
_MAX_SAMPLES = 10_000  # per window: beyond it the oldest go first (bounds memory and the sort at high rates)
_PREFIX = "splitserve:"


@dataclass(frozen=True, kw_only=True)
class Quantiles:
    """Latency percentiles over a window, in seconds (nearest rank), and how many samples they rest on."""

    p50: float
    p90: float
    p99: float
    num_samples: int

    def at(self, quantile: float) -> float:
        """The value at one of QUANTILES."""
        return {0.5: self.p50, 0.9: self.p90, 0.99: self.p99}[quantile]


class LatencyWindow:
    """Samples of one latency from the last `window_s` seconds (on the caller's clock: time.monotonic())."""

    def __init__(self, window_s: float, *, max_samples: int = _MAX_SAMPLES) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time, seconds), time-ordered

    def add(self, now_s: float, value_s: float) -> None:
        self._samples.append((now_s, value_s))

    def quantiles(self, now_s: float) -> Quantiles | None:
        """The window's percentiles as of `now_s`; None when it holds no sample."""
        samples = self._samples
        while samples and samples[0][0] <= now_s - self.window_s:
            samples.popleft()
        if not samples:
            return None
        values = sorted(value for _, value in samples)
        p50, p90, p99 = (values[max(math.ceil(q * len(values)) - 1, 0)] for q in QUANTILES)
        return Quantiles(p50=p50, p90=p90, p99=p99, num_samples=len(values))


@dataclass(frozen=True, kw_only=True)
class PoolSignals:
    """One pool's signals at one moment (see the module docstring)."""

    num_workers: int
    num_requests_waiting: int = 0
    num_requests_running: int = 0
    num_queued_prompt_tokens: int = 0
    kv_cache_usage_mean: float = 0.0
    kv_cache_usage_max: float = 0.0
    num_gateway_queued: int = 0
    ttft_s: Quantiles | None = None  # set on the prefill (or colocated) pool
    tpot_s: Quantiles | None = None  # set on the decode (or colocated) pool


def pool_signals(snapshots: Sequence[WorkerSnapshot], roles: Sequence[str], *, ttft_s: Quantiles | None,
                 tpot_s: Quantiles | None, num_gateway_queued: int, target_role: str) -> dict[str, PoolSignals]:
    """Each of `roles`' signals from the registry's snapshots and the windows' percentiles. `target_role`: the pool
    Generate goes to (decode, or colocated), whose room the gateway's admission queue waits for."""
    signals = {}
    for role in roles:
        pool = [s for s in snapshots if s.info.role == role and not s.info.draining]  # a leaving worker: no signal
        loads = [s.stats for s in pool if s.stats is not None]
        usage = [stats.kv_cache_usage for stats in loads]
        signals[role] = PoolSignals(
            num_workers=len(pool),
            num_requests_waiting=sum(stats.num_requests_waiting for stats in loads),
            num_requests_running=sum(stats.num_requests_running for stats in loads),
            num_queued_prompt_tokens=sum(stats.num_queued_prompt_tokens for stats in loads),
            kv_cache_usage_mean=sum(usage) / len(usage) if usage else 0.0,
            kv_cache_usage_max=max(usage, default=0.0),
            num_gateway_queued=num_gateway_queued if role == target_role else 0,
            ttft_s=ttft_s if role in TTFT_POOLS else None,
            tpot_s=tpot_s if role in TPOT_POOLS else None,
        )
    return signals


class PoolSignalCollector(Collector):
    """The `splitserve:pool_*` families, from `signals()` at scrape time; every pool present, 0 when idle.

        splitserve:pool_num_workers{pool}                      gauge
        splitserve:pool_num_requests_waiting{pool}             gauge
        splitserve:pool_num_requests_running{pool}             gauge
        splitserve:pool_num_queued_prompt_tokens{pool}         gauge
        splitserve:pool_kv_cache_usage_perc{pool,stat}         gauge  stat = mean | max, 0-1 as vLLM's
        splitserve:pool_time_to_first_token_seconds{pool,quantile}   gauge  over the window; absent when empty
        splitserve:pool_time_per_output_token_seconds{pool,quantile} gauge  over the window; absent when empty
        splitserve:pool_latency_window_samples{pool,metric}    gauge  samples behind those (metric = ttft | tpot)
    """

    def __init__(self, signals: Callable[[], Mapping[str, PoolSignals]]) -> None:
        self._signals = signals

    def collect(self) -> Iterator[Metric]:
        signals = self._signals()
        counts = {
            "num_workers": ("Workers in the pool.", lambda s: s.num_workers),
            "num_requests_waiting": ("Requests waiting in the pool's engines.", lambda s: s.num_requests_waiting),
            "num_requests_running": ("Requests running in the pool's engines.", lambda s: s.num_requests_running),
            "num_queued_prompt_tokens": ("Prompt tokens the pool's engines have yet to compute.",
                                         lambda s: s.num_queued_prompt_tokens),
        }
        for name, (documentation, read) in counts.items():
            family = GaugeMetricFamily(f"{_PREFIX}pool_{name}", documentation, labels=["pool"])
            for pool, s in signals.items():
                family.add_metric([pool], float(read(s)))
            yield family
        usage = GaugeMetricFamily(f"{_PREFIX}pool_kv_cache_usage_perc",
                                  "KV-cache usage over the pool's workers, 0-1: their mean and their max.",
                                  labels=["pool", "stat"])
        for pool, s in signals.items():
            usage.add_metric([pool, "mean"], s.kv_cache_usage_mean)
            usage.add_metric([pool, "max"], s.kv_cache_usage_max)
        yield usage
        ttft = GaugeMetricFamily(f"{_PREFIX}pool_time_to_first_token_seconds",
                                 "Time to first token over the signal window, by quantile.",
                                 labels=["pool", "quantile"])
        tpot = GaugeMetricFamily(f"{_PREFIX}pool_time_per_output_token_seconds",
                                 "Time per output token over the signal window, by quantile.",
                                 labels=["pool", "quantile"])
        samples = GaugeMetricFamily(f"{_PREFIX}pool_latency_window_samples",
                                    "Requests in the signal window behind the latency quantiles.",
                                    labels=["pool", "metric"])
        for pool, s in signals.items():
            for family, metric, window, pools in ((ttft, "ttft", s.ttft_s, TTFT_POOLS),
                                                  (tpot, "tpot", s.tpot_s, TPOT_POOLS)):
                if pool not in pools:
                    continue
                samples.add_metric([pool, metric], float(window.num_samples if window is not None else 0))
                if window is not None:
                    for q in QUANTILES:
                        family.add_metric([pool, str(q)], window.at(q))
        yield ttft
        yield tpot
        yield samples
