"""The autoscaler loop around the pure policy: it carries resizes out through the PoolController, logs and counts
each, starts the cool-down when the resize returned, and survives a controller that refuses. And the signals it
reads: the sliding latency window and the per-pool aggregation of worker loads."""

from __future__ import annotations

import asyncio
import logging

import pytest

from protos import serving_pb2
from protos.worker_info import WorkerInfo
from router.admin import PoolWorker
from router.autoscale_policy import AutoscalePolicy, PoolBounds
from router.autoscaler import Autoscaler, AutoscalerConfig
from router.pool_signals import LatencyWindow, PoolSignals, Quantiles, pool_signals
from router.worker_registry import WorkerSnapshot

POLICY = AutoscalePolicy(prefill=PoolBounds(min_workers=1, max_workers=2), decode=PoolBounds(min_workers=1,
                         max_workers=1), ttft_slo_s=0.5, tpot_slo_s=0.1, scale_up_cooldown_s=10.0,
                         scale_down_cooldown_s=20.0)
SLOW = Quantiles(p50=1.0, p90=2.0, p99=3.0, num_samples=5)


class FakeController:
    """Resizes as told, taking `scale_s` of the fake clock; refuses while `refuse` is set."""

    def __init__(self, clock: list[float], sizes: dict[str, int]) -> None:
        self.clock = clock
        self.sizes = sizes
        self.calls: list[tuple[str, int]] = []
        self.refuse = False
        self.sizes_unknown = False
        self.scale_s = 7.0

    def scale(self, role: str, num_workers: int) -> None:
        self.calls.append((role, num_workers))
        self.clock[0] += self.scale_s
        if self.refuse:
            raise RuntimeError("the controller is shutting down")
        self.sizes[role] = num_workers

    def pool_workers(self) -> list[PoolWorker]:
        return []

    def pool_sizes(self) -> dict[str, int]:
        if self.sizes_unknown:
            raise TimeoutError("the controller is busy")
        return dict(self.sizes)


def make(ttft: Quantiles | None) -> tuple[Autoscaler, FakeController, list[float], list[tuple[str, str]]]:
    clock = [100.0]
    controller = FakeController(clock, {"prefill": 1, "decode": 1})
    resized: list[tuple[str, str]] = []

    def signals() -> dict[str, PoolSignals]:  # the registry's count: stale on purpose (the cluster's is used)
        return {"prefill": PoolSignals(num_workers=0, ttft_s=ttft), "decode": PoolSignals(num_workers=0)}

    scaler = Autoscaler(AutoscalerConfig(policy=POLICY, interval_s=1.0), controller, signals,
                        on_resize=lambda pool, direction: resized.append((pool, direction)), clock=lambda: clock[0])
    return scaler, controller, clock, resized


def test_a_resize_is_carried_out_logged_and_counted_and_cools_down_from_its_end(caplog) -> None:
    scaler, controller, clock, resized = make(SLOW)
    with caplog.at_level(logging.INFO, logger="router.autoscaler"):
        decisions = asyncio.run(scaler.tick())
    assert [(d.pool, d.direction) for d in decisions] == [("prefill", "up"), ("decode", "hold")]
    assert controller.calls == [("prefill", 2)] and resized == [("prefill", "up")]
    assert "prefill 1 -> 2 workers: TTFT p90 2.000 s > SLO 0.5 s" in caplog.text
    assert scaler.states["prefill"].last_change_s == 107.0  # when scale() returned, not when it was decided

    controller.sizes["prefill"] = 1  # as if an admin shrank it again: pressure again, but within the cool-down
    clock[0] = 116.0
    asyncio.run(scaler.tick())
    assert controller.calls == [("prefill", 2)]
    clock[0] = 117.0
    asyncio.run(scaler.tick())
    assert controller.calls == [("prefill", 2), ("prefill", 2)]


def test_a_refused_resize_is_logged_and_not_retried_before_the_cooldown(caplog) -> None:
    scaler, controller, clock, _ = make(SLOW)
    controller.refuse = True
    with caplog.at_level(logging.WARNING, logger="router.autoscaler"):
        asyncio.run(scaler.tick())
        clock[0] += 1.0
        asyncio.run(scaler.tick())
    assert controller.calls == [("prefill", 2)]
    assert "resizing prefill to 2 failed: the controller is shutting down" in caplog.text


def test_no_decision_while_the_pool_sizes_are_unknown(caplog) -> None:
    scaler, controller, _, _ = make(SLOW)
    controller.sizes_unknown = True
    with caplog.at_level(logging.WARNING, logger="router.autoscaler"):
        assert asyncio.run(scaler.tick()) == []
    assert controller.calls == [] and "the pool sizes are unknown (the controller is busy)" in caplog.text
    controller.sizes_unknown = False
    assert [d.direction for d in asyncio.run(scaler.tick())] == ["up", "hold"]


def test_the_loop_ticks_until_cancelled() -> None:
    scaler, controller, _, _ = make(SLOW)
    scaler._config = AutoscalerConfig(policy=POLICY, interval_s=0.01)

    async def run_briefly() -> None:
        task = asyncio.create_task(scaler.run())
        while not controller.calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(run_briefly(), timeout=10))
    assert controller.calls == [("prefill", 2)]


def test_the_latency_window_gives_nearest_rank_percentiles_of_its_last_seconds() -> None:
    window = LatencyWindow(10.0)
    assert window.quantiles(0.0) is None
    for i in range(100):
        window.add(float(i) / 10, float(100 - i))  # 100 samples over 10 s: 100, 99, ..., 1
    assert window.quantiles(9.9) == Quantiles(p50=50.0, p90=90.0, p99=99.0, num_samples=100)
    assert window.quantiles(15.0) == Quantiles(p50=25.0, p90=45.0, p99=49.0, num_samples=49)  # t > 5 s: 49..1
    assert window.quantiles(30.0) is None
    small = LatencyWindow(10.0, max_samples=3)
    for i in range(5):
        small.add(0.0, float(i))
    assert small.quantiles(1.0) == Quantiles(p50=3.0, p90=4.0, p99=4.0, num_samples=3)
    with pytest.raises(ValueError, match="window_s"):
        LatencyWindow(0.0)


def test_pool_signals_sum_and_average_each_pools_workers() -> None:
    def snapshot(worker_id: str, role: str, **load: float) -> WorkerSnapshot:
        stats = serving_pb2.LoadStats(**load) if load else None  # type: ignore[arg-type]
        return WorkerSnapshot(info=WorkerInfo(worker_id=worker_id, role=role, endpoint="x:1"), healthy=True,
                              stats=stats)

    snapshots = [
        snapshot("prefill-0", "prefill", num_requests_waiting=3, num_requests_running=1, num_queued_prompt_tokens=700,
                 kv_cache_usage=0.1),
        snapshot("prefill-1", "prefill", num_requests_waiting=2, num_queued_prompt_tokens=50, kv_cache_usage=0.3),
        snapshot("prefill-2", "prefill"),  # not polled yet: counted as a worker, no load
        snapshot("decode-0", "decode", num_requests_running=6, kv_cache_usage=0.8),
    ]
    ttft, tpot = SLOW, Quantiles(p50=0.1, p90=0.2, p99=0.3, num_samples=9)
    signals = pool_signals(snapshots, ("prefill", "decode"), ttft_s=ttft, tpot_s=tpot, num_gateway_queued=4,
                           target_role="decode")
    assert signals["prefill"] == PoolSignals(num_workers=3, num_requests_waiting=5, num_requests_running=1,
                                             num_queued_prompt_tokens=750, kv_cache_usage_mean=pytest.approx(0.2),
                                             kv_cache_usage_max=0.3, ttft_s=ttft)
    assert signals["decode"] == PoolSignals(num_workers=1, num_requests_running=6, kv_cache_usage_mean=0.8,
                                            kv_cache_usage_max=0.8, num_gateway_queued=4, tpot_s=tpot)
