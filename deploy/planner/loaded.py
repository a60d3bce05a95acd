"""Stage costs under load: the profile's loaded probe (a real `serve` of one layout driven at Poisson rates, its
gateway's TTFT stage histograms read over each run) turned into what `plan --one-host` prices. Pure, no I/O.

Why: a served request spends time the engine's profile cannot see. On SmolLM2 over gRPC on 2 cores
(docs/benchmarks.md, "Profiles and plans", passes 4 and 5) the served handoff's stage took 3-8x the transport's own
time, and 0.1-0.4 s of each TTFT lay outside the stages the model simulates, growing with the rate; the model,
which knew neither, put 1P+1D's TTFT p50 at half the measured at 1.5 req/s in every pass.

For each probe point (rate r, its run's N requests), with the probe's layout and traffic priced as a finite run
(finite_run.py) on the profile's costs:

    handoff_extra_s  the run's mean kv_transfer stage - the transport fit's handoff of the probe's prompt (>= 0):
                     a served handoff also waits for the sender's and the receiver's engine threads, checksums
                     and commits, which the transport's own timing leaves out
    overhead_s       the measured TTFT mean outside the four simulated stages (router queue, prefill queue,
                     prefill, KV transfer: the decode worker's commit and first step, the stream to the client)
                     - the simulated run's (which already holds the profile's serving overhead), >= 0

The prefill compute is not recalibrated: the model already slows it by what the host's other work takes
(`contention_slowdown` of the gateway's measured CPU), and one probe run's prefill stage moves with the host's
other load by as much as the effect (docs/benchmarks.md, pass 5: the probe's run at 0.7 req/s found the prefill
1.14x the model, the checks that followed 0.87x-1.13x). What the probe adds is what no engine measurement sees.

`LoadedCosts.at(rate)` interpolates them linearly in the rate, each made non-decreasing across the points (a
stage never costs less at a higher rate); outside the points it holds the nearest one's. Held, not extrapolated,
beyond the highest: the probe's upper rate already keeps most of a small host busy (SmolLM2 on 2 cores: 1.5 of
them at half its prefill capacity), and what lies outside the stages measured nearly flat from there on (0.29 s at
both 1.5 and 2.0 req/s in pass 3; 0.28, 0.34, 0.38 s at 1.5, 2.0, 2.5 in pass 5, where linear extrapolation from
the probe's 0.09 and 0.30 s at 0.7 and 1.4 priced 0.48 and 0.63 s).

A layout model applies them (planner.LayoutModel) when planning --one-host, the layout is of the probe's kind
(colocated or disaggregated over the probe's transport), and `PlanOptions.loaded_costs` is on: its handoff +
handoff_extra_s, its TTFT + overhead_s. The probe's client (AIPerf on the same host) is inside these measurements:
`--client-cores` then counts only a load generator beyond it. Interpolating in the rate carries the probe's
traffic (its isl and osl) into other traffic: the costs are right for traffic like the probe's, a guide for the
rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.planner.planner import Layout, PlanOptions
    from deploy.planner.profile import Loaded, Profile

FIELDS = ("handoff_extra_s", "overhead_s")


@dataclass(frozen=True, kw_only=True)
class LoadedCost:
    rate: float
    handoff_extra_s: float = 0.0
    overhead_s: float = 0.0


class LoadedCosts:
    """The calibrated points (see the module docstring); `at(rate)` the costs at any rate."""

    def __init__(self, points: list[LoadedCost]) -> None:
        if not points:
            raise ValueError("loaded costs need at least one point")
        ordered = sorted(points, key=lambda p: p.rate)
        monotone = [ordered[0]]
        for p in ordered[1:]:  # never lower at a higher rate
            monotone.append(dataclasses.replace(p, **{f: max(getattr(p, f), getattr(monotone[-1], f))
                                                     for f in FIELDS}))
        self.points = tuple(monotone)

    def at(self, rate: float) -> LoadedCost:
        pts = self.points
        if len(pts) == 1 or rate <= pts[0].rate:
            return dataclasses.replace(pts[0], rate=rate)
        if rate >= pts[-1].rate:
            return dataclasses.replace(pts[-1], rate=rate)
        hi = next(i for i in range(1, len(pts)) if rate <= pts[i].rate)
        a, b = pts[hi - 1], pts[hi]
        t = (rate - a.rate) / (b.rate - a.rate)
        return LoadedCost(rate=rate, **{f: getattr(a, f) + (getattr(b, f) - getattr(a, f)) * t for f in FIELDS})


class _Fixed:
    """The same costs at every rate (what the calibration tries)."""

    def __init__(self, cost: LoadedCost) -> None:
        self.cost = cost

    def at(self, rate: float) -> LoadedCost:
        return self.cost


def probe_layout(loaded: Loaded) -> Layout:
    from deploy.planner.planner import Layout

    if loaded.colocated:
        return Layout(num_colocated=loaded.num_colocated, max_num_seqs=loaded.max_num_seqs)
    return Layout(num_prefill=loaded.num_prefill, num_decode=loaded.num_decode, max_num_seqs=loaded.max_num_seqs,
                  transport=loaded.transport)


def calibrate(profile: Profile, options: PlanOptions) -> LoadedCosts:
    """The probe's points as LoadedCosts (the module docstring), priced with `options` but for the load generator
    (the probe's is inside its measurements) and the loaded costs themselves."""
    from deploy.planner.finite_run import simulate
    from deploy.planner.planner import LayoutModel, Traffic

    loaded = profile.loaded
    if loaded is None:
        raise ValueError("the profile has no loaded probe (splitserve profile --loaded-requests)")
    base = dataclasses.replace(options, one_host=True, client_cores=0.0, loaded_costs=False)
    model = LayoutModel(profile, Traffic(isl=loaded.isl, osl=loaded.osl), probe_layout(loaded), base)
    out = []
    for point in loaded.points:
        extra = max(0.0, point.kv_transfer_s - model.handoff_s) if model.handoff_s else 0.0
        model.loaded = _Fixed(LoadedCost(rate=point.rate, handoff_extra_s=extra))
        run = simulate(model, point.rate, point.num_requests)
        measured_outside = point.ttft_mean_s - (point.router_queue_s + point.prefill_queue_s + point.prefill_s
                                                + point.kv_transfer_s)
        simulated_outside = run.ttft_mean_s - sum(run.stages.values())
        out.append(LoadedCost(rate=point.rate, handoff_extra_s=extra,
                              overhead_s=max(0.0, measured_outside - simulated_outside)))
    return LoadedCosts(out)


_CACHE: dict[tuple[int, float | None], tuple[Profile, LoadedCosts]] = {}


def loaded_costs(profile: Profile, layout: Layout, options: PlanOptions) -> LoadedCosts | None:
    """The loaded costs a layout model prices `layout` with (None where they do not apply: see the module
    docstring), calibrated once per profile and serving overhead."""
    loaded = profile.loaded
    if loaded is None or not options.one_host or not options.loaded_costs or loaded.colocated != layout.colocated:
        return None
    if not layout.colocated and layout.transport != loaded.transport:
        return None
    if layout.num_ranks != layout.num_workers:  # the probe served size 1; a handoff at other sizes travels as lanes
        return None
    key = (id(profile), options.serving_overhead_s)
    cached = _CACHE.get(key)
    if cached is None or cached[0] is not profile:  # an id reused by another profile
        if len(_CACHE) >= 16:
            _CACHE.clear()
        cached = _CACHE[key] = (profile, calibrate(profile, options))
    return cached[1]


def describe(profile: Profile, options: PlanOptions) -> str:
    """One line saying which layouts a plan prices with the loaded probe's costs, and what they are ("" where
    none: no probe, not --one-host, or --no-loaded-costs)."""
    loaded = profile.loaded
    layout = None if loaded is None else probe_layout(loaded)
    costs = None if layout is None else loaded_costs(profile, layout, options)
    if loaded is None or costs is None:
        return ""
    kind = "colocated layouts" if loaded.colocated else f"disaggregated layouts over {loaded.transport}"

    def each(values: list[float], unit: str, scale: float) -> str:
        return ", ".join(f"+{v * scale:.{0 if scale > 1 else 2}f}" for v in values) + f" {unit}"

    rates = ", ".join(f"{p.rate:g}" for p in costs.points)
    return (f"{kind} priced with the profile's loaded probe ({layout.label} under {loaded.client or 'a client'} at "
            f"{rates} req/s): handoff {each([p.handoff_extra_s for p in costs.points], 'ms', 1e3)} over the "
            f"transport's, TTFT {each([p.overhead_s for p in costs.points], 's', 1)} outside the stages "
            "(--no-loaded-costs: without)")
