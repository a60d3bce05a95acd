"""The built-in autoscaler (`serve --autoscale`): a task in the gateway's event loop, where the signals are.

    every interval_s: the pools' configured sizes from the cluster (a restarting worker counts, though the
    registry does not list it while it restarts); then for each pool in turn:
        signals()  ──▶  autoscale_policy.decide_pool  ──▶  hold: nothing (the reason at DEBUG)
                                                      └─▶  up / down: log the reason (INFO), count it
                                                           (splitserve:autoscaler_decisions_total{pool,direction}),
                                                           controller.scale(pool, target) in a thread (it blocks
                                                           until the new worker serves or the old one is gone),
                                                           refresh the registry so routing sees the new pool

The policy is pure (router/autoscale_policy.py); this module only keeps its state, reads the clock and carries
decisions out through the cluster controller (`ScalableCluster`: the admin API's `PoolController` plus
`pool_sizes`). A pool's cool-downs count from when its resize returned, so a slow scale-up (a model load) is not
followed at once by another. A failed resize is logged and counts as a change too (no retry storm against a
controller that refuses).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from router.admin import PoolController
from router.config_checks import POSITIVE, check_fields, checked
from router.autoscale_policy import HOLD, POOLS, AutoscalePolicy, Decision, PoolState, decide_pool
from router.pool_signals import PoolSignals

logger = logging.getLogger(__name__)


class ScalableCluster(PoolController, Protocol):
    """The admin API's controller, plus each pool's configured size (may block: called in a thread)."""

    def pool_sizes(self) -> Mapping[str, int]: ...


@dataclass(frozen=True, kw_only=True)
class AutoscalerConfig:
    policy: AutoscalePolicy
    interval_s: float = checked(POSITIVE, default=5.0)  # between ticks

    def __post_init__(self) -> None:
        check_fields(self)


class Autoscaler:
    def __init__(
        self,
        config: AutoscalerConfig,
        controller: ScalableCluster,
        signals: Callable[[], Mapping[str, PoolSignals]],
        *,
        on_resize: Callable[[str, str], None] = lambda pool, direction: None,
        refresh: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._controller = controller
        self._signals = signals
        self._on_resize = on_resize
        self._refresh = refresh
        self._clock = clock
        self.states: dict[str, PoolState] = {pool: PoolState() for pool in POOLS}

    async def run(self) -> None:
        """Tick every interval until cancelled; a failed tick is logged and the next one runs."""
        while True:
            await asyncio.sleep(self._config.interval_s)
            try:
                await self.tick()
            except Exception:  # keep scaling whatever one tick did
                logger.exception("autoscaler tick failed")

    async def tick(self) -> list[Decision]:
        """Decide for each pool on fresh signals and carry out the resizes; returns the decisions."""
        try:
            sizes = await asyncio.to_thread(self._controller.pool_sizes)
        except Exception as exc:  # noqa: BLE001 - a busy or lost controller: no decision on a wrong count
            logger.warning("the pool sizes are unknown (%s); no decision this tick", exc)
            return []
        decisions = []
        for pool in POOLS:
            signals = self._signals().get(pool)
            if signals is None or pool not in sizes:
                continue
            signals = replace(signals, num_workers=sizes[pool])
            decision = decide_pool(self._config.policy, pool, signals, self.states[pool], self._clock())
            decisions.append(decision)
            self.states[pool] = decision.state
            if decision.direction == HOLD:
                logger.debug("%s holds at %d workers: %s", pool, decision.current, decision.reason)
                continue
            logger.info("%s %d -> %d workers: %s", pool, decision.current, decision.target,
                        decision.reason)
            self._on_resize(pool, decision.direction)
            try:
                await asyncio.to_thread(self._controller.scale, pool, decision.target)
            except Exception as exc:  # noqa: BLE001 - the controller's refusal or a lost actor: logged, cooled down
                logger.warning("resizing %s to %d failed: %s", pool, decision.target, exc)
            self.states[pool] = replace(self.states[pool], last_change_s=self._clock())
            if self._refresh is not None:
                await self._refresh()
        return decisions
