"""A finite run: N requests at Poisson rate R through one layout, simulated event by event. Pure, no I/O, seeded.

The steady-state model (planner.py, queueing.py) prices a pool that runs forever, so past its capacity it can only
say "unstable". A check of N requests (AIPerf's --request-count) is finite: past capacity its backlog grows for
the length of the run and then drains, and the gateway refuses what its admission queue cannot hold. This module
prices such a run by replaying it: each request through the gateway's admission, the workers' engines and the KV
handoff, with the step costs of a `LayoutModel` (the profile's fits, scaled for the host as the steady model
scales them). A simulation rather than a fluid backlog formula because the admission rule couples the pools in a
way a formula does not follow (a disaggregated request holds its gateway slot while it waits for the prefill
worker, so the prefill queue is capped by the decode pool's slots, and the gateway's queue beyond it), and the
engine's step rule (running first, then prompts within the token budget) decides both TPOT and the prompts' wait.

What is simulated (each rule is the code's: router/admission.py, engine/core/scheduler.py, decode_worker/worker.py):

    arrivals     request i at the sum of i exponential gaps of mean 1/R (the first at 0): AIPerf's Poisson
                 schedule; `num_runs` runs of seeds seed..seed+num_runs-1, the same unit gaps at every rate (common
                 random numbers: a prediction moves smoothly with R)
    gateway      slots = the decode (or colocated) pool's max_num_seqs, summed, within its KV blocks (prompt + 1
                 tokens a request); a request is dispatched when nothing is queued and fewer than `slots` are in
                 flight (dispatch to the end of its stream), else queued FIFO while fewer than `slots` wait and the
                 expected wait ((queued + 1) x mean hold / slots) is within the queue timeout, else refused (429);
                 one still queued after the timeout leaves with a 503 (counted refused too)
    dispatch     the worker of each pool with the fewest of the gateway's requests on it
    engine step  running sequences first (a token each), then waiting prompts within the token budget
                 (max_num_batched_tokens; a longer prompt is chunked) and max_num_seqs; it takes the prefill fit of
                 its prompt tokens (one intercept) plus, with sequences decoding, the decode step of that batch
    colocated    a prompt's first token at the end of the step that finishes its prefill, then osl - 1 steps
    disaggregated  the prefill worker's step holds only prompts; a prompt's KV reaches its decode worker
                 handoff_s after, and the worker commits it between steps: its first token there (the stream's
                 first), then osl - 1 steps
    stages       each completed request's router queue (arrival to dispatch), prefill queue (dispatch to the first
                 step computing its prompt), prefill (that step's start to the end of the step computing its last
                 tokens) and, disaggregated, KV transfer (the handoff): the means of the gateway's
                 ttft_stage_seconds histograms for the same request (their other stages are not simulated)
    reported     TTFT = first token - arrival + the serving overhead; TPOT = (last - first token) / (osl - 1), AIPerf's
                 inter-token latency; p50 and p90 over each run's completed requests (linear interpolation, as
                 AIPerf's numpy), averaged over the runs; refused: the mean count; goodput: completed requests
                 within both SLOs over the run's span (first arrival to last token), averaged
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.config import GatewayConfig

if TYPE_CHECKING:
    from deploy.planner.planner import LayoutModel

QUEUE_TIMEOUT_S = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}["queue_timeout_s"]  # its default
HOLD_WEIGHT = 0.1  # router/admission.py's moving mean of a request's hold time
NUM_RUNS = 12


@dataclass(frozen=True)
class FiniteRun:
    """What a run of `num_requests` at `rate` is predicted to measure (inf where no request completes)."""

    num_requests: int
    rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    num_refused: float  # mean over the runs: refused at arrival (429) or timed out in the queue (503)
    goodput: float  # requests/s within both SLOs
    throughput: float  # completed requests/s over the run's span
    ttft_mean_s: float = math.inf  # over the runs' completed requests
    # the mean seconds of each TTFT stage the gateway times (router/metrics.py's ttft_stage_seconds): router_queue,
    # prefill_queue, prefill, and kv_transfer where KV moves (averaged over the runs' completed requests)
    stages: dict[str, float] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.inf
    k = (len(ordered) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class _Request:
    index: int
    arrival_s: float
    prompt_left: int  # prompt tokens still to compute on the worker that prefills it
    tokens_left: int  # output tokens still to stream after the first
    worker: _Worker | None = None  # the worker it decodes on (colocated: also prefills)
    prefill_worker: _Worker | None = None
    dispatched_s: float = math.nan
    prefill_start_s: float = math.nan  # the first step computing its prompt began
    prefill_end_s: float = math.nan  # the step computing its prompt's last tokens ended
    first_token_s: float = math.nan
    done_s: float = math.nan

    def stages(self, handoff_s: float) -> dict[str, float]:
        """Its TTFT stages as the gateway's ttft_stage_seconds histograms time them (router/metrics.py)."""
        out = {"router_queue": self.dispatched_s - self.arrival_s,
               "prefill_queue": self.prefill_start_s - self.dispatched_s,
               "prefill": self.prefill_end_s - self.prefill_start_s}
        if self.prefill_worker is not None:
            out["kv_transfer"] = handoff_s
        return out


class _Costs:
    """A layout's step costs at one rate's contention, read off a LayoutModel."""

    def __init__(self, model: LayoutModel, rate: float, prefill_factor: float, decode_factor: float) -> None:
        self.model = model
        self.handoff_s, self.serving_overhead_s = model.handoff_at(rate), model.serving_overhead_at(rate)
        fit = model.profile.prefill
        self.prefill_scale = prefill_factor * model.prefill_slowdown
        self.prefill_intercept_s = fit.intercept_s
        self.per_token_s, self.per_token_context_s = fit.per_token_s, fit.per_token_context_s
        self.decode_factor = decode_factor

    def prefill_s(self, chunks: list[tuple[int, int]]) -> float:
        """One step's prefill of `chunks` (new tokens, tokens before them): one intercept for the step."""
        work = sum(self.per_token_s * n + self.per_token_context_s * n * (before + n / 2) for n, before in chunks)
        return self.prefill_scale * (self.prefill_intercept_s + work)

    def decode_s(self, batch: int) -> float:
        return self.model.step_s(batch, self.decode_factor)


class _Worker:
    """One engine: its waiting queue and running sequences, stepping while it has work. `prefills`: it computes
    prompts; `decodes`: it streams their tokens (a prefill worker hands each prompt off instead)."""

    def __init__(self, sim: _Simulation, *, prefills: bool, decodes: bool) -> None:
        self.sim, self.prefills, self.decodes = sim, prefills, decodes
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.num_assigned = 0  # the gateway's requests on it (routing's load)
        self.version = 0  # bumped to cancel a scheduled step end
        self.busy = False
        # A run of identical decode-only steps, ended early when work arrives: its start, step time and length.
        self.run_start_s = 0.0
        self.run_step_s = 0.0
        self.run_steps = 0
        self.step_chunks: list[tuple[_Request, int]] = []  # the prompt tokens the step in progress computes

    def enqueue(self, request: _Request, now_s: float) -> None:
        self.waiting.append(request)
        if not self.busy:
            self._start_step(now_s)
        elif self.run_steps > 1:  # decode-only steps under way: join at the next boundary (run_steps is 0 while a
            # step's end is being processed, which starts the next step itself)
            done = min(self.run_steps, math.floor((now_s - self.run_start_s) / self.run_step_s + 1e-9) + 1)
            if done < self.run_steps:
                self.run_steps = done
                self.version += 1
                self.sim.schedule(self.run_start_s + done * self.run_step_s, self._end_step, self.version)

    def _start_step(self, now_s: float) -> None:
        """Build the next step from the running sequences and the waiting queue (scheduler.py's rule)."""
        budget = self.sim.token_budget
        decoding = [r for r in self.running if r.prompt_left == 0]
        budget -= len(decoding)
        chunks: list[tuple[_Request, int]] = []
        for r in self.running:
            if r.prompt_left > 0 and budget > 0:
                chunks.append((r, min(r.prompt_left, budget)))
                budget -= chunks[-1][1]
        while self.waiting and budget > 0 and len(self.running) < self.sim.max_num_seqs:
            r = self.waiting.popleft()
            if r.prompt_left == 0:  # disaggregated: its KV arrived, committed between steps, first token now
                r.first_token_s = now_s
                self.running.append(r)
                budget -= 1
                if r.tokens_left == 0:  # one output token: done at its commit (finished as an event: no re-entry)
                    self.running.remove(r)
                    self.sim.schedule(now_s, lambda t, req: self.sim.finish(req, t), r)
                continue
            self.running.append(r)
            chunks.append((r, min(r.prompt_left, budget)))
            budget -= chunks[-1][1]
        for r, _ in chunks:
            if math.isnan(r.prefill_start_s):
                r.prefill_start_s = now_s
        decoding = [r for r in self.running if r.prompt_left == 0]
        if not chunks and not decoding:
            self.busy = False
            return
        self.busy = True
        self.step_chunks = chunks
        costs = self.sim.costs
        step_s = costs.decode_s(len(decoding)) if decoding else 0.0
        if chunks:
            step_s += costs.prefill_s([(n, self.sim.isl - r.prompt_left) for r, n in chunks])
            steps = 1
        else:  # only decodes: identical steps until one finishes (or work arrives, which cuts the run short)
            steps = min(r.tokens_left for r in decoding)
            if self.waiting and len(self.running) < self.sim.max_num_seqs:
                steps = 1
        self.run_start_s, self.run_step_s, self.run_steps = now_s, step_s, steps
        self.version += 1
        self.sim.schedule(now_s + steps * step_s, self._end_step, self.version)

    def _end_step(self, now_s: float, version: int) -> None:
        if version != self.version:
            return
        steps, self.run_steps = self.run_steps, 0
        computed = {id(r): n for r, n in self.step_chunks}
        self.step_chunks = []
        finished: list[_Request] = []
        still: list[_Request] = []
        for r in self.running:
            if r.prompt_left > 0:
                r.prompt_left -= computed.get(id(r), 0)
                if r.prompt_left == 0:
                    r.prefill_end_s = now_s
                if r.prompt_left == 0 and self.decodes:
                    r.first_token_s = now_s
                    (finished if r.tokens_left == 0 else still).append(r)
                elif r.prompt_left == 0:  # a prefill worker: hand the KV off
                    self.sim.hand_off(r, now_s)
                else:
                    still.append(r)
                continue
            r.tokens_left -= steps
            (finished if r.tokens_left <= 0 else still).append(r)
        self.running = still
        for r in finished:
            self.sim.finish(r, now_s)
        self._start_step(now_s)


class _Simulation:
    """One run: the event queue, the gateway's admission and the workers."""

    def __init__(self, model: LayoutModel, costs: _Costs, arrivals_s: list[float]) -> None:
        layout, traffic, profile = model.layout, model.traffic, model.profile
        self.costs = costs
        self.isl, self.osl = traffic.isl, traffic.osl
        self.new_tokens = traffic.num_new_tokens
        self.max_num_seqs = layout.max_num_seqs
        self.token_budget = int(profile.engine.get("max_num_batched_tokens") or self.new_tokens) or self.new_tokens
        self.serving_overhead_s = costs.serving_overhead_s
        self.handoff_s = costs.handoff_s
        self.events: list[tuple[float, int, object, tuple]] = []
        self.num_events = 0
        num_decode = layout.num_colocated or layout.num_decode
        prefills_here = layout.colocated or model.local
        self.decoders = [_Worker(self, prefills=prefills_here, decodes=True) for _ in range(num_decode)]
        self.prefillers = [] if prefills_here else [_Worker(self, prefills=True, decodes=False)
                                                     for _ in range(layout.num_prefill)]
        # The gateway counts each request's blocks to start (prompt + 1 tokens) against the pool's KV.
        block_size = profile.kv.block_size
        start_blocks = math.ceil((traffic.isl + 1) / block_size)
        by_blocks = num_decode * model.num_kv_blocks // max(1, start_blocks)
        self.slots = max(1, min(num_decode * layout.max_num_seqs, by_blocks))
        self.in_flight = 0
        self.queue: deque[_Request] = deque()
        self.mean_hold_s = 0.0
        self.refused = 0
        self.completed: list[_Request] = []
        for i, t in enumerate(arrivals_s):
            self.schedule(t, self._arrive, _Request(index=i, arrival_s=t, prompt_left=self.new_tokens,
                                                    tokens_left=self.osl - 1))

    def schedule(self, at_s: float, handler: object, *args: object) -> None:
        self.num_events += 1
        heapq.heappush(self.events, (at_s, self.num_events, handler, args))

    def run(self) -> None:
        while self.events:
            at_s, _, handler, args = heapq.heappop(self.events)
            handler(at_s, *args)  # type: ignore[operator]

    # -- the gateway --------------------------------------------------------------------------------------------
    def _arrive(self, now_s: float, request: _Request) -> None:
        if not self.queue and (self.in_flight < self.slots or self.in_flight == 0):
            self._dispatch(request, now_s)
            return
        expected_wait_s = (len(self.queue) + 1) * self.mean_hold_s / self.slots
        if len(self.queue) < self.slots and expected_wait_s <= QUEUE_TIMEOUT_S:
            self.queue.append(request)
            self.schedule(now_s + QUEUE_TIMEOUT_S, self._time_out, request)
        else:
            self.refused += 1

    def _time_out(self, now_s: float, request: _Request) -> None:
        if math.isnan(request.dispatched_s) and request in self.queue:
            self.queue.remove(request)
            self.refused += 1

    def _dispatch(self, request: _Request, now_s: float) -> None:
        self.in_flight += 1
        request.dispatched_s = now_s
        request.worker = min(self.decoders, key=lambda w: w.num_assigned)
        request.worker.num_assigned += 1
        if self.prefillers:
            request.prefill_worker = min(self.prefillers, key=lambda w: w.num_assigned)
            request.prefill_worker.num_assigned += 1
            request.prefill_worker.enqueue(request, now_s)
        else:
            request.worker.enqueue(request, now_s)

    def hand_off(self, request: _Request, now_s: float) -> None:
        assert request.prefill_worker is not None and request.worker is not None
        request.prefill_worker.num_assigned -= 1
        self.schedule(now_s + self.handoff_s, lambda t, r: r.worker.enqueue(r, t), request)

    def finish(self, request: _Request, now_s: float) -> None:
        assert request.worker is not None
        request.done_s = now_s
        request.worker.num_assigned -= 1
        self.completed.append(request)
        self.in_flight -= 1
        held_s = now_s - request.dispatched_s
        self.mean_hold_s = held_s if self.mean_hold_s == 0 else self.mean_hold_s + HOLD_WEIGHT * (
            held_s - self.mean_hold_s)
        while self.queue and self.in_flight < self.slots:
            self._dispatch(self.queue.popleft(), now_s)


def unit_gaps(num_requests: int, seed: int) -> list[float]:
    """Arrival times of a Poisson process of rate 1, the first at 0 (divide by the rate)."""
    rng = random.Random(seed)
    out, t = [0.0], 0.0
    for _ in range(num_requests - 1):
        t += rng.expovariate(1.0)
        out.append(t)
    return out


def simulate(model: LayoutModel, rate: float, num_requests: int, *, ttft_slo_s: float = math.inf,
             tpot_slo_s: float = math.inf, num_runs: int = NUM_RUNS, seed: int = 0) -> FiniteRun:
    """`num_runs` runs of `num_requests` at `rate` through `model`'s layout (see the module docstring). The host's
    background (the gateway's CPU, --client-cores) is priced at the rate the run completes requests, not the
    offered one: past capacity the gateway streams what the pool serves."""
    if num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {num_requests}")
    runs = [unit_gaps(num_requests, seed + k) for k in range(num_runs)]
    result, served = _simulate_at(model, rate, rate, num_requests, runs, ttft_slo_s, tpot_slo_s)
    if served < rate * 0.9:  # saturated: the gateway's CPU follows what is served
        result, _ = _simulate_at(model, rate, served, num_requests, runs, ttft_slo_s, tpot_slo_s)
    return result


def _simulate_at(model: LayoutModel, rate: float, served_rate: float, num_requests: int, runs: list[list[float]],
                 ttft_slo_s: float, tpot_slo_s: float) -> tuple[FiniteRun, float]:
    """The runs priced at `served_rate`'s background, and the rate they completed requests at (between the first
    and the last completion: the pool's pace, not the run's drain)."""
    prefill_factor, decode_factor = model.contention(served_rate)
    if math.isinf(prefill_factor) or math.isinf(decode_factor):
        return FiniteRun(num_requests=num_requests, rate=rate, ttft_p50_s=math.inf, ttft_p90_s=math.inf,
                         tpot_p50_s=math.inf, tpot_p90_s=math.inf, num_refused=float(num_requests), goodput=0.0,
                         throughput=0.0), 0.0
    costs = _Costs(model, served_rate, prefill_factor, decode_factor)
    osl = model.traffic.osl
    totals = {"ttft50": 0.0, "ttft90": 0.0, "ttft_mean": 0.0, "tpot50": 0.0, "tpot90": 0.0, "refused": 0.0,
              "goodput": 0.0, "throughput": 0.0, "served": 0.0}
    stage_totals: dict[str, list[float]] = {}  # each run's mean
    for gaps in runs:
        sim = _Simulation(model, costs, [t / rate for t in gaps])
        sim.run()
        per_request = [r.stages(sim.handoff_s) for r in sim.completed]
        for name in (per_request[0] if per_request else {}):
            stage_totals.setdefault(name, []).append(sum(st[name] for st in per_request) / len(per_request))
        ttfts = [r.first_token_s - r.arrival_s + sim.serving_overhead_s for r in sim.completed]
        tpots = [(r.done_s - r.first_token_s) / (osl - 1) if osl > 1 else 0.0 for r in sim.completed]
        totals["ttft50"] += percentile(ttfts, 50)
        totals["ttft90"] += percentile(ttfts, 90)
        totals["ttft_mean"] += sum(ttfts) / len(ttfts) if ttfts else math.inf
        totals["tpot50"] += percentile(tpots, 50)
        totals["tpot90"] += percentile(tpots, 90)
        totals["refused"] += sim.refused
        span_s = max((r.done_s for r in sim.completed), default=0.0)
        if span_s > 0:
            good = sum(1 for a, b in zip(ttfts, tpots) if a <= ttft_slo_s and b <= tpot_slo_s)
            totals["goodput"] += good / span_s
            totals["throughput"] += len(sim.completed) / span_s
        done_s = sorted(r.done_s for r in sim.completed)
        paced = len(done_s) > 1 and done_s[-1] > done_s[0]
        totals["served"] += (len(done_s) - 1) / (done_s[-1] - done_s[0]) if paced else rate
    n = len(runs)
    return FiniteRun(num_requests=num_requests, rate=rate, ttft_p50_s=totals["ttft50"] / n,
                     ttft_p90_s=totals["ttft90"] / n, tpot_p50_s=totals["tpot50"] / n, tpot_p90_s=totals["tpot90"] / n,
                     num_refused=totals["refused"] / n, goodput=totals["goodput"] / n,
                     throughput=totals["throughput"] / n, ttft_mean_s=totals["ttft_mean"] / n,
                     stages={name: sum(means) / len(means) for name, means in stage_totals.items()}), totals["served"] / n
