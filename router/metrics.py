"""The router's Prometheus metrics: vLLM's names with a `splitserve:` prefix, on a private registry.

Measured here, per request (router clock):
    splitserve:time_to_first_token_seconds      histogram  arrival -> first token received from the worker
    splitserve:inter_token_latency_seconds      histogram  between token messages of one stream
    splitserve:e2e_request_latency_seconds      histogram  arrival -> last message
    splitserve:ttft_stage_seconds{stage}        histogram  the TTFT breakdown, one label value per stage:
        router_queue (this router: arrival -> dispatched), decode_queue, prefill_queue, peer_fetch, prefill,
        kv_transfer (from the StageTimings of the stream's first message; kv_transfer only when KV bytes moved,
        peer_fetch only when the prompt's head was fetched from a peer)
    splitserve:kv_transfer_seconds              histogram  per request, when KV moved (= the kv_transfer stage)
    splitserve:request_success_total{finished_reason}  counter  stop | length | abort (client went away, or
                                                          the worker aborted it)
    splitserve:request_failure_total{reason}    counter    no_worker | unavailable | timeout | bad_request
                                                           (the worker refused it) | worker_error |
                                                           worker_aborted (before its first token) | a failed
                                                           KV handoff, by why (kv_transfer/handoff_failure.py):
                                                           kv_transfer_timeout | kv_transfer_refused |
                                                           kv_transfer_checksum | kv_transfer_failed |
                                                           prefill_unavailable | prefill_timeout |
                                                           prefill_failed | kv_transfer (its worker named none)
    splitserve:request_retries_total{reason}    counter    dispatches retried before any token: unavailable
                                                           (target unreachable) | aborted (KV handoff failed)
    splitserve:request_migrations_total{reason} counter    streams resumed on another decode worker after theirs
                                                           went away mid-stream (router/migration.py):
                                                           worker_unavailable | stream_cut | server_cancelled;
                                                           past --max-migrations: request_failure{migration_limit}
    splitserve:prompt_tokens_total, splitserve:generation_tokens_total   counters

API keys (router/api_keys.py; a key is named by its id, never by itself):
    splitserve:api_key_requests_total{key_id}   counter    requests admitted, per key id ("key-" + 8 hex digits)
    splitserve:api_key_rejections_total{reason} counter    missing_key | invalid_key (401) | rate_limited (429)

Autoscaling (router/pool_signals.py; per pool, label pool = prefill | decode | colocated):
    splitserve:pool_num_workers, splitserve:pool_num_requests_waiting, splitserve:pool_num_requests_running,
    splitserve:pool_num_queued_prompt_tokens, splitserve:pool_kv_cache_usage_perc{stat=mean|max}    gauges
    splitserve:pool_time_to_first_token_seconds{quantile}, splitserve:pool_time_per_output_token_seconds{quantile}
                                                gauges     p50/p90/p99 over the last --autoscale-window seconds
    splitserve:pool_latency_window_samples{metric}  gauge  requests behind those percentiles (ttft | tpot)
    splitserve:autoscaler_decisions_total{pool,direction}  counter  the built-in autoscaler's resizes: up | down

Admission (router/admission.py):
    splitserve:admission_queue_requests         gauge      requests waiting in this gateway's queue
    splitserve:admission_in_flight_requests     gauge      requests this gateway dispatched and not yet ended
    splitserve:admission_queue_time_seconds     histogram  arrival in the queue -> dispatched (0 when not queued)
    splitserve:admission_rejections_total{reason}  counter queue_full (429) | queue_timeout (503)

Peer fetch (router/peer_fetch.py; worker/peer_fetch.py):
    splitserve:kv_peer_fetch_decisions_total{decision}  counter  fetch | recompute: a prompt whose head another
                                                     worker holds, by the cheaper path as priced
    splitserve:kv_peer_fetch_estimate_seconds{path}  histogram  both prices of each such decision (fetch, recompute)
    splitserve:kv_peer_fetch_blocks_total{worker}, kv_peer_fetch_bytes_total{worker}  counters  what the worker
                                                     fetched from peers
    splitserve:kv_peer_fetch_failures_total{worker,reason}  counter  fetches that ended in a recompute: gone |
                                                     timeout | unavailable | refused | transfer

Routing and the prefix index (router/prefix_routing.py):
    splitserve:requests_by_prefill_path_total{path}  counter  remote (a prefill worker ran the prompt and its KV
                                                     moved) | local (the decode worker prefilled it: conditional
                                                     disaggregation) | colocated
    splitserve:prefix_index_up                  gauge      1 while Redis answers
    splitserve:prefix_index_lookups_total{outcome}  counter  ok | error | down (skipped: Redis unreachable)
    splitserve:prefix_index_lookup_seconds      histogram  one lookup's round trip
    splitserve:prefix_index_predictions_total{outcome}  counter  match | mismatch: the index's overlap for the
                                                     worker that prefilled, against the prefix hit it reported
    splitserve:prefix_index_blocks{worker,tier}  gauge     blocks the index lists for the worker's registered
                                                     incarnation, by the tier they are on: device | disk | host
                                                     (read from Redis at scrape time; absent while it is down)
    splitserve:prefix_cache_hit_rate{worker}    gauge      the worker's prefix-cache hits / queries (tokens)

From the cluster controller (`restart_counts`), label values for every pool in the mode:
    splitserve:worker_restarts_total{role,reason}  counter  process_died | stalled | unresponsive |
                                                            restart_failed (see deploy/controller.py)

Read from each worker's latest LoadStats at scrape time (label `worker` = worker_id):
    gauges   splitserve:num_requests_running, splitserve:num_requests_waiting, splitserve:num_requests_receiving_kv
             (a decode worker's requests whose prompt KV is on its way), splitserve:kv_blocks_used,
             splitserve:kv_blocks_total, splitserve:kv_cache_usage_perc (a 0-1 fraction, as in vLLM),
             splitserve:worker_healthy (1/0),
             splitserve:worker_quantization_info{worker,quantization} (1: the --quantization its weights run with)
             splitserve:worker_rank_weight_bytes{worker,rank}, worker_rank_kv_cache_bytes{worker,rank} (each
             tensor-parallel rank's weights and KV cache shard; rank "0" alone at TP 1)
             splitserve:kv_lane_bytes_total{worker,rank,direction} (counter; TP > 1: the KV handoff bytes each
             rank sent from its own cache or took into it, direction sent | received)
             splitserve:cpu_kernels_info{worker,kernel,variant} (1: the C++ CPU kernel build the worker runs,
             variant "x86-64-v4" | "x86-64-v3" | ..., or "torch" where its torch ops run instead)
    counters splitserve:prefix_cache_queries_total, splitserve:prefix_cache_hits_total{worker,tier} (tokens; tier
             device, or disk / host: the KV offload tier's, or peer: fetched from another worker),
             splitserve:kv_offload_bytes_total{worker,direction} (write, read: the KV offload tier's),
             splitserve:kv_transfer_bytes_total, splitserve:num_preemptions_total,
             splitserve:kv_transfers_total, splitserve:kv_transfer_failures_total,
             splitserve:kv_transfers_rejected_total{worker,reason} (KV pushes a decode worker refused before any
             block reached its cache: unknown_transfer | wrong_source | layout_mismatch | block_count | checksum |
             malformed)
             splitserve:spec_decode_num_drafts_total, splitserve:spec_decode_num_draft_tokens_total,
             splitserve:spec_decode_num_accepted_tokens_total,
             splitserve:spec_decode_num_accepted_tokens_per_pos_total{worker,position} (speculating workers)
    histogram splitserve:spec_decode_chosen_k{worker}  the k the speculation policy chose, per decoding request
             and step (one bucket per k; speculating workers only)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from protos import serving_pb2
from router.pool_signals import LatencyWindow

if TYPE_CHECKING:
    from router.peer_fetch import PeerFetchPlan
    from router.prefix_index_client import PrefixIndexClient
    from router.routing import Route
    from router.worker_registry import WorkerSnapshot

PREFIX = "splitserve:"
PREFILL_PATHS = ("remote", "local", "colocated")
STAGES = ("router_queue", "decode_queue", "prefill_queue", "peer_fetch", "prefill", "kv_transfer")

# vLLM's buckets, so dashboards built for vLLM read these the same way.
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                  240.0, 480.0, 960.0, 1920.0, 7680.0)
_STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0, 300.0)


RestartCounts = Callable[[], Sequence[tuple[str, str, int]]]  # (role, reason, restarts)
RESTART_REASONS = ("process_died", "stalled", "unresponsive", "restart_failed")  # deploy/controller.py's


class RouterMetrics:
    """Owns the registry. `render()` is the /metrics body; refresh worker loads before calling it."""

    def __init__(self, snapshots: Callable[[], Sequence[WorkerSnapshot]], *, roles: Sequence[str] = (),
                 restart_counts: RestartCounts | None = None, signal_window_s: float = 60.0) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        # The autoscaling signals' sliding windows (router/pool_signals.py), on time.monotonic().
        self.ttft_window = LatencyWindow(signal_window_s)
        self.tpot_window = LatencyWindow(signal_window_s)
        self.autoscaler_decisions = Counter(
            f"{PREFIX}autoscaler_decisions", "Pool resizes the built-in autoscaler decided, by pool and direction.",
            ["pool", "direction"], registry=registry)
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time to first token, seen by the router.",
            buckets=_TTFT_BUCKETS_S, registry=registry)
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Time between token messages of one stream.",
            buckets=_ITL_BUCKETS_S, registry=registry)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Arrival to last token, seen by the router.",
            buckets=_E2E_BUCKETS_S, registry=registry)
        self.kv_transfer_seconds = Histogram(
            f"{PREFIX}kv_transfer_seconds", "Per request: prefill worker's KV transfer, opened to acked.",
            buckets=_STAGE_BUCKETS_S, registry=registry)
        self.ttft_stage_seconds = Histogram(
            f"{PREFIX}ttft_stage_seconds", "Time to first token, by stage.", ["stage"],
            buckets=_STAGE_BUCKETS_S, registry=registry)
        self.request_success = Counter(
            f"{PREFIX}request_success", "Requests finished, by finish reason.", ["finished_reason"],
            registry=registry)
        self.request_failure = Counter(
            f"{PREFIX}request_failure", "Requests that failed, by reason.", ["reason"], registry=registry)
        self.request_retries = Counter(
            f"{PREFIX}request_retries", "Dispatches retried before any token, by the failed attempt's status.",
            ["reason"], registry=registry)
        self.request_migrations = Counter(
            f"{PREFIX}request_migrations", "Requests resumed on another worker after theirs went away mid-stream, "
            "by reason.", ["reason"], registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", registry=registry)
        self.admission_queue_requests = Gauge(
            f"{PREFIX}admission_queue_requests", "Requests waiting in this gateway's admission queue.",
            registry=registry)
        self.admission_in_flight_requests = Gauge(
            f"{PREFIX}admission_in_flight_requests", "Requests this gateway dispatched that have not ended.",
            registry=registry)
        self.admission_queue_time = Histogram(
            f"{PREFIX}admission_queue_time_seconds", "Time a request waited in the admission queue.",
            buckets=_STAGE_BUCKETS_S, registry=registry)
        self.admission_rejections = Counter(
            f"{PREFIX}admission_rejections", "Requests refused by admission control, by reason.", ["reason"],
            registry=registry)
        for reason in ("queue_full", "queue_timeout"):
            self.admission_rejections.labels(reason=reason)
        for stage in STAGES:  # every stage shows up at once, with zero counts, so dashboards need no guards
            self.ttft_stage_seconds.labels(stage=stage)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(finished_reason=reason)
        self.prefill_path = Counter(
            f"{PREFIX}requests_by_prefill_path", "Requests dispatched, by where their prompt is prefilled.",
            ["path"], registry=registry)
        for path in PREFILL_PATHS:
            self.prefill_path.labels(path=path)
        self.api_key_requests = Counter(
            f"{PREFIX}api_key_requests", "Requests admitted, by API key id.", ["key_id"], registry=registry)
        self.api_key_rejections = Counter(
            f"{PREFIX}api_key_rejections", "Requests refused by API key checks, by reason.", ["reason"],
            registry=registry)
        self.kv_peer_fetch_decisions = Counter(
            f"{PREFIX}kv_peer_fetch_decisions", "Prompts whose head another worker holds, by the cheaper path: "
            "fetch it from that worker, or recompute it.", ["decision"], registry=registry)
        self.kv_peer_fetch_estimate = Histogram(
            f"{PREFIX}kv_peer_fetch_estimate_seconds", "Both priced paths of each peer fetch decision.", ["path"],
            buckets=_STAGE_BUCKETS_S, registry=registry)
        for path in ("fetch", "recompute"):
            self.kv_peer_fetch_decisions.labels(decision=path)
            self.kv_peer_fetch_estimate.labels(path=path)
        registry.register(WorkerLoadCollector(snapshots))
        registry.register(RestartCollector(roles, restart_counts or (lambda: ())))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_route(self, route: Route) -> None:
        if route.prefill is not None:
            path = "remote"
        else:
            path = "colocated" if route.target.role == "colocated" else "local"
        self.prefill_path.labels(path=path).inc()

    def count_peer_fetch(self, plan: PeerFetchPlan) -> None:
        self.kv_peer_fetch_decisions.labels(decision="fetch" if plan.fetch else "recompute").inc()
        self.kv_peer_fetch_estimate.labels(path="fetch").observe(plan.fetch_s)
        self.kv_peer_fetch_estimate.labels(path="recompute").observe(plan.recompute_s)

    def tracker(self, arrival_s: float) -> RequestTracker:
        return RequestTracker(self, arrival_s)


class RequestTracker:
    """One request's timeline, on `time.perf_counter()` seconds. Feed it every message of the stream."""

    def __init__(self, metrics: RouterMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self.arrival_s = arrival_s
        self.router_queue_s = 0.0
        self._last_token_s: float | None = None
        self._first_token_s: float | None = None
        self._num_tokens = 0
        self._timings_seen = False
        self._done = False
        # Called once with prompt + generated tokens when the request finishes (the API key's token charge).
        self.on_finished: Callable[[int], None] | None = None

    def dispatched(self) -> float:
        """Mark the request as sent to a worker; returns the router_queue_s to send along."""
        self.router_queue_s = time.perf_counter() - self.arrival_s
        return self.router_queue_s

    def on_message(self, message: serving_pb2.GenerateResponse) -> None:
        now = time.perf_counter()
        if not self._timings_seen and message.HasField("timings"):
            self._timings_seen = True
            self._observe_stages(message.timings)
        if message.token_ids:
            if self._last_token_s is None:
                self._metrics.time_to_first_token.observe(now - self.arrival_s)
                self._metrics.ttft_window.add(time.monotonic(), now - self.arrival_s)
                self._first_token_s = now
            else:
                self._metrics.inter_token_latency.observe(now - self._last_token_s)
            self._last_token_s = now
            self._num_tokens += len(message.token_ids)

    def finished(self, finish_reason: str, *, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        """The request ended with `finish_reason` (stop | length | abort); counted once."""
        if self._done:
            return
        self._done = True
        self._observe_tpot()
        metrics = self._metrics
        metrics.e2e_request_latency.observe(time.perf_counter() - self.arrival_s)
        metrics.request_success.labels(finished_reason=finish_reason).inc()
        metrics.prompt_tokens.inc(num_prompt_tokens)
        metrics.generation_tokens.inc(num_generated_tokens)
        if self.on_finished is not None:
            self.on_finished(num_prompt_tokens + num_generated_tokens)

    def retried(self, reason: str) -> None:
        """One attempt failed before any token and the request goes out again."""
        self._metrics.request_retries.labels(reason=reason).inc()

    def migrated(self, reason: str) -> None:
        """The request's decode worker went away mid-stream and the request resumes on another (reason: why)."""
        self._metrics.request_migrations.labels(reason=reason).inc()

    def failed(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        self._observe_tpot()
        self._metrics.request_failure.labels(reason=reason).inc()

    def _observe_tpot(self) -> None:
        """The request's time per output token, into the signal window, once it streamed two tokens or more."""
        if self._first_token_s is not None and self._last_token_s is not None and self._num_tokens >= 2:
            tpot_s = (self._last_token_s - self._first_token_s) / (self._num_tokens - 1)
            self._metrics.tpot_window.add(time.monotonic(), tpot_s)

    def _observe_stages(self, timings: serving_pb2.StageTimings) -> None:
        stage = self._metrics.ttft_stage_seconds
        stage.labels(stage="router_queue").observe(self.router_queue_s)
        stage.labels(stage="decode_queue").observe(timings.decode_queue_s)
        stage.labels(stage="prefill_queue").observe(timings.prefill_queue_s)
        if timings.peer_fetch_bytes > 0:
            stage.labels(stage="peer_fetch").observe(timings.peer_fetch_s)
        stage.labels(stage="prefill").observe(timings.prefill_s)
        if timings.kv_transfer_bytes > 0:  # a request that ended on its first token moved no KV
            stage.labels(stage="kv_transfer").observe(timings.kv_transfer_s)
            self._metrics.kv_transfer_seconds.observe(timings.kv_transfer_s)


class WorkerLoadCollector(Collector):
    """Worker gauges and counters from the registry's latest LoadStats, read at scrape time."""

    def __init__(self, snapshots: Callable[[], Sequence[WorkerSnapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snapshots = self._snapshots()
        gauges = {
            "num_requests_running": ("Requests running on the worker.", lambda s: s.num_requests_running),
            "num_requests_waiting": ("Requests waiting on the worker.", lambda s: s.num_requests_waiting),
            "num_requests_receiving_kv": ("Requests whose prompt KV is on its way to the (decode) worker.",
                                          lambda s: s.num_requests_receiving_kv),
            "kv_cache_usage_perc": ("KV-cache usage, 0-1 (1 = all blocks in use).", lambda s: s.kv_cache_usage),
            "kv_blocks_used": ("KV blocks referenced by requests.", lambda s: s.kv_blocks_used),
            "kv_blocks_total": ("KV blocks the worker has.", lambda s: s.kv_blocks_total),
        }
        counters = {
            "prefix_cache_queries": ("Prefix-cache queries, in tokens.", lambda s: s.prefix_cache_queries),
            "kv_transfer_bytes": ("KV bytes sent (prefill) or received (decode).", lambda s: s.kv_transfer_bytes),
            "num_preemptions": ("Requests preempted.", lambda s: s.num_preemptions),
            "kv_transfers": ("KV transfers completed.", lambda s: s.num_kv_transfers),
            "kv_transfer_failures": ("KV transfers failed.", lambda s: s.num_kv_transfer_failures),
            "spec_decode_num_drafts": ("Speculative verifications (request-steps with drafts).",
                                       lambda s: s.spec_decode_num_drafts),
            "spec_decode_num_draft_tokens": ("Draft tokens verified.", lambda s: s.spec_decode_num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Draft tokens accepted.",
                                                lambda s: s.spec_decode_num_accepted_tokens),
        }
        for name, (documentation, read) in gauges.items():
            family = GaugeMetricFamily(f"{PREFIX}{name}", documentation, labels=["worker"])
            for snapshot in snapshots:
                if snapshot.stats is not None:
                    family.add_metric([snapshot.info.worker_id], float(read(snapshot.stats)))
            yield family
        for name, (documentation, read) in counters.items():
            family = CounterMetricFamily(f"{PREFIX}{name}", documentation, labels=["worker"])
            for snapshot in snapshots:
                if snapshot.stats is not None:
                    family.add_metric([snapshot.info.worker_id], float(read(snapshot.stats)))
            yield family
        rejected = CounterMetricFamily(f"{PREFIX}kv_transfers_rejected",
                                       "KV pushes the decode worker refused before any block reached its cache.",
                                       labels=["worker", "reason"])
        for snapshot in snapshots:
            if snapshot.stats is not None:
                for reason, n in sorted(snapshot.stats.kv_transfers_rejected.items()):
                    rejected.add_metric([snapshot.info.worker_id, reason], float(n))
        yield rejected
        yield from _spec_decode_families(snapshots)
        yield from _tier_families(snapshots)
        yield from _lora_families(snapshots)
        hit_rate = GaugeMetricFamily(f"{PREFIX}prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries, in tokens, since the worker started.",
                                     labels=["worker"])
        for snapshot in snapshots:
            if snapshot.stats is not None and snapshot.stats.prefix_cache_queries:
                hit_rate.add_metric([snapshot.info.worker_id],
                                    snapshot.stats.prefix_cache_hits / snapshot.stats.prefix_cache_queries)
        yield hit_rate
        healthy = GaugeMetricFamily(f"{PREFIX}worker_healthy", "1 when the worker's last GetLoad answered.",
                                    labels=["worker", "role"])
        for snapshot in snapshots:
            healthy.add_metric([snapshot.info.worker_id, snapshot.info.role], 1.0 if snapshot.healthy else 0.0)
        yield healthy
        kernels = GaugeMetricFamily(f"{PREFIX}cpu_kernels_info", "The C++ CPU kernel build each worker runs "
                                    "(variant \"torch\": its torch ops run instead).",
                                    labels=["worker", "kernel", "variant"])
        for snapshot in snapshots:
            if snapshot.stats is not None:
                for kernel in snapshot.stats.cpu_kernels:
                    kernels.add_metric([snapshot.info.worker_id, kernel.kernel, kernel.variant], 1.0)
        yield kernels
        quantization = GaugeMetricFamily(f"{PREFIX}worker_quantization_info", "The --quantization each worker's "
                                         "weights run with (none, int8, gguf, fp8).", labels=["worker", "quantization"])
        for snapshot in snapshots:
            if snapshot.stats is not None:
                quantization.add_metric([snapshot.info.worker_id, snapshot.stats.quantization or "none"], 1.0)
        yield quantization
        rank_weights = GaugeMetricFamily(f"{PREFIX}worker_rank_weight_bytes", "Bytes of weights each tensor-parallel "
                                         "rank of a worker holds (rank 0 alone at TP 1).", labels=["worker", "rank"])
        rank_kv = GaugeMetricFamily(f"{PREFIX}worker_rank_kv_cache_bytes", "Bytes of each tensor-parallel rank's "
                                    "shard of a worker's paged KV cache.", labels=["worker", "rank"])
        for snapshot in snapshots:
            if snapshot.stats is not None:
                for rank in snapshot.stats.ranks:
                    rank_weights.add_metric([snapshot.info.worker_id, str(rank.rank)], float(rank.weight_bytes))
                    rank_kv.add_metric([snapshot.info.worker_id, str(rank.rank)], float(rank.kv_cache_bytes))
        yield rank_weights
        yield rank_kv
        lane_bytes = CounterMetricFamily(f"{PREFIX}kv_lane_bytes", "KV handoff bytes each tensor-parallel rank of a "
                                         "worker sent from its own cache or took into it, rank to rank "
                                         "(kv_transfer/rank_lanes.py).", labels=["worker", "rank", "direction"])
        for snapshot in snapshots:
            if snapshot.stats is not None and len(snapshot.stats.ranks) > 1:
                for rank in snapshot.stats.ranks:
                    for direction, value in (("sent", rank.kv_lane_bytes_sent),
                                             ("received", rank.kv_lane_bytes_received)):
                        lane_bytes.add_metric([snapshot.info.worker_id, str(rank.rank), direction], float(value))
        yield lane_bytes


class RestartCollector(Collector):
    """splitserve:worker_restarts_total{role,reason}: the controller's counts, every (pool, reason) present at 0."""

    def __init__(self, roles: Sequence[str], restart_counts: RestartCounts) -> None:
        self._roles = tuple(roles)
        self._restart_counts = restart_counts

    def collect(self) -> Iterator[Metric]:
        counts = {(role, reason): 0 for role in self._roles for reason in RESTART_REASONS}
        for role, reason, n in self._restart_counts():
            counts[(role, reason)] = n
        family = CounterMetricFamily(f"{PREFIX}worker_restarts", "Workers restarted by the controller, by reason.",
                                     labels=["role", "reason"])
        for (role, reason), n in sorted(counts.items()):
            family.add_metric([role, reason], float(n))
        yield family


class PrefixIndexCollector(Collector):
    """The prefix index client's state and counters, read at scrape time, and the blocks per worker and tier its
    last `worker_stats` found (the /metrics handler refreshes them before rendering: `refresh_stats`)."""

    def __init__(self, client: PrefixIndexClient) -> None:
        self._client = client
        self._lookup_seconds = Histogram(f"{PREFIX}prefix_index_lookup_seconds", "One prefix index lookup.",
                                         buckets=_STAGE_BUCKETS_S, registry=None)

    def collect(self) -> Iterator[Metric]:
        counters = self._client.counters
        pending, counters.lookup_seconds = counters.lookup_seconds, []
        for seconds in pending:
            self._lookup_seconds.observe(seconds)
        up = GaugeMetricFamily(f"{PREFIX}prefix_index_up", "1 while the prefix index (Redis) answers.")
        up.add_metric([], 1.0 if self._client.up else 0.0)
        yield up
        lookups = CounterMetricFamily(f"{PREFIX}prefix_index_lookups", "Prefix index lookups, by outcome.",
                                      labels=["outcome"])
        for outcome, n in sorted(counters.lookups.items()):
            lookups.add_metric([outcome], float(n))
        yield lookups
        predictions = CounterMetricFamily(
            f"{PREFIX}prefix_index_predictions", "Whether the index predicted the prefill worker's prefix hit.",
            labels=["outcome"])
        for outcome, n in sorted(counters.predictions.items()):
            predictions.add_metric([outcome], float(n))
        yield predictions
        blocks = GaugeMetricFamily(f"{PREFIX}prefix_index_blocks",
                                   "Blocks the prefix index lists per worker, by the tier they are on (device, and "
                                   "a KV offload tier's disk or host).", labels=["worker", "tier"])
        for stats in self._client.last_worker_stats:
            for tier, n in stats.num_blocks_by_tier.items():
                blocks.add_metric([stats.worker_id, tier], float(n))
        yield blocks
        yield from self._lookup_seconds.collect()


def _lora_families(snapshots: Sequence[WorkerSnapshot]) -> Iterator[Metric]:
    """LoRA adapters (--enable-lora) per worker: vLLM's lora_requests_info (the adapters its requests run and wait
    under, comma-joined, and its --max-loras), and the requests under each adapter by state."""
    info = GaugeMetricFamily(f"{PREFIX}lora_requests_info", "The LoRA adapters a worker's running and waiting "
                             "requests run under (comma-joined), and its --max-loras.",
                             labels=["worker", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    requests = GaugeMetricFamily(f"{PREFIX}lora_requests", "Requests of a worker under each LoRA adapter, by state.",
                                 labels=["worker", "lora_name", "state"])
    for snapshot in snapshots:
        stats = snapshot.stats
        if stats is None or not stats.max_loras:
            continue
        worker = snapshot.info.worker_id
        info.add_metric([worker, str(stats.max_loras), ",".join(sorted(stats.lora_requests_running)),
                         ",".join(sorted(stats.lora_requests_waiting))], 1.0)
        for state, counts in (("running", stats.lora_requests_running), ("waiting", stats.lora_requests_waiting)):
            for name, n in sorted(counts.items()):
                requests.add_metric([worker, name, state], float(n))
    yield info
    yield requests


def _tier_families(snapshots: Sequence[WorkerSnapshot]) -> Iterator[Metric]:
    """Prefix-cache hits by tier (`device`, and a KV offload tier's `disk` or `host`) and the offload tier's bytes
    by direction (`write`: device to tier, `read`: tier to device)."""
    hits = CounterMetricFamily(f"{PREFIX}prefix_cache_hits",
                               "Prompt tokens served without computing them, by tier (device: the prefix cache; "
                               "disk, host: the KV offload tier).", labels=["worker", "tier"])
    offload = CounterMetricFamily(f"{PREFIX}kv_offload_bytes", "KV bytes the worker's offload tier wrote and read.",
                                  labels=["worker", "direction"])
    fetched = CounterMetricFamily(f"{PREFIX}kv_peer_fetch_blocks", "KV blocks the worker fetched from peers.",
                                  labels=["worker"])
    fetched_bytes = CounterMetricFamily(f"{PREFIX}kv_peer_fetch_bytes", "KV bytes the worker fetched from peers.",
                                        labels=["worker"])
    fetch_failures = CounterMetricFamily(f"{PREFIX}kv_peer_fetch_failures",
                                         "Peer fetches that failed (the blocks were computed instead), by reason.",
                                         labels=["worker", "reason"])
    for snapshot in snapshots:
        stats = snapshot.stats
        if stats is None:
            continue
        worker_id = snapshot.info.worker_id
        hits.add_metric([worker_id, "device"], float(stats.prefix_cache_hits))
        for tier, num_tokens in sorted(stats.prefix_cache_hits_by_tier.items()):
            if tier != "device":
                hits.add_metric([worker_id, tier], float(num_tokens))
        for direction, num_bytes in sorted(stats.kv_offload_bytes.items()):
            offload.add_metric([worker_id, direction], float(num_bytes))
        fetched.add_metric([worker_id], float(stats.kv_peer_fetch_blocks))
        fetched_bytes.add_metric([worker_id], float(stats.kv_peer_fetch_bytes))
        for reason, count in sorted(stats.kv_peer_fetch_failures.items()):
            fetch_failures.add_metric([worker_id, reason], float(count))
    yield from (hits, offload, fetched, fetched_bytes, fetch_failures)


def _spec_decode_families(snapshots: Sequence[WorkerSnapshot]) -> Iterator[Metric]:
    """Draft tokens accepted per draft position (vLLM's name and `position` label), and the distribution of the
    k the speculation policy chose per decoding request and step, as a histogram with one bucket per k."""
    per_pos = CounterMetricFamily(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, per draft position (0: the first draft).",
                                  labels=["worker", "position"])
    chosen_k = HistogramMetricFamily(f"{PREFIX}spec_decode_chosen_k",
                                     "Drafts the policy chose per decoding request and step (0: none).",
                                     labels=["worker"])
    for snapshot in snapshots:
        stats = snapshot.stats
        if stats is None or not stats.spec_decode_chosen_k:
            continue
        worker = snapshot.info.worker_id
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([worker, str(position)], float(count))
        cumulative, buckets = 0, []
        for k, count in enumerate(stats.spec_decode_chosen_k):
            cumulative += count
            buckets.append((str(float(k)), float(cumulative)))
        buckets.append(("+Inf", float(cumulative)))
        total_k = sum(k * count for k, count in enumerate(stats.spec_decode_chosen_k))
        chosen_k.add_metric([worker], buckets, float(total_k))
    yield per_pos
    yield chosen_k
