"""The planner: a pure function from a profile, a traffic mix and an SLO to ranked layouts. No I/O, no torch.

    plan(profile, traffic, slo, options) -> Plan(ranked predictions, the recommendation, why none meets)

A layout is a colocated pool of N workers, or a disaggregated one of P prefill + D decode workers, with the
engine's --max-num-seqs and the gateway's --disagg-prefill-threshold, and each pool's tensor-parallel size among
those the profile measured (its `tensor_parallel`: each phase's time at size N over size 1's on the same cores,
which scales that pool's compute; a worker of size N counts N ranks, as many devices, or on one host N shares of
the cores). Its prediction, per request of `isl` prompt
tokens (of which `prefix_hit` are cached) and `osl` output tokens, at `rate` requests/s (Poisson):

    prefill service  s_p = prefill(n new, c cached), + one intercept per extra chunk of max_num_batched_tokens;
                     at load a worker batches the prompts waiting, sharing one step's intercept between them
    prefill queue    M/D/c over the prefill pool (colocated: over the whole pool, its prompts stalling decodes)
    decode batch     B per worker from Little's law: B = r * osl * TPOT(B), r = rate / D, solved in closed form
                     for the linear step curve; capped at min(--max-num-seqs, KV capacity / (isl + osl)), beyond
                     which requests wait for a slot (M/M/c over D x slots)
    TPOT             step(B, isl + osl/2) plus, colocated, the prefills a request sits through while it decodes
                     (r * its lifetime of them, each s_p): p90 with B and that count at their Poisson p90s
    TTFT             prefill queue + s_p (+ the KV handoff of the prompt's blocks over the transport + half a
                     decode step to join the batch, disaggregated) + the wait for a decode slot
    goodput          rate * P(TTFT <= SLO) * P(TPOT <= SLO) (tails from the queue's, TPOT as a normal)

A layout meets the SLO when its TTFT p90 and TPOT p90 are within it. With `--one-host` every worker shares the
profiled machine's cores, as `serve` splits them (cpu_count // workers threads each): its compute times scale by
what the profile measured one thread to cost each phase (`host_share_slowdown`). What serving adds on top of the
engine, from the profile's `serving` (a real `serve`, measured; absent: nothing):

    TTFT         + the serving overhead (gateway, HTTP, tokenizing, routing, the stream's first chunk), or
                 --serving-overhead-s
    decode step  + the step overhead (a served step over the engine's own), on workers that hold as many threads
                 as the profile's (where it was measured; on one host a worker of fewer leaves a core to it)
    one host     the gateway's CPU, rate x (per request + osl x per token), and the load generator's
                 (--client-cores) busy other cores of the same machine: each phase's compute times scale by
                 `contention_slowdown` of those background cores, at the rate priced
    under load   with --one-host and a profile holding a loaded probe (a served layout under AIPerf), layouts of
                 the probe's kind add its served handoff's extra time to the handoff and the TTFT it measured
                 outside the simulated stages to the TTFT, at the rate priced (loaded.py; --no-loaded-costs: not)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from deploy.planner.finite_run import simulate
from deploy.planner.loaded import LoadedCosts, loaded_costs
from deploy.planner.profile import Profile
from deploy.planner.queueing import NO_WAIT, Wait, erlang_c, mgc_wait, poisson_quantile

SEQ_CANDIDATES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, kw_only=True)
class Traffic:
    isl: int  # prompt tokens per request
    osl: int  # output tokens per request
    prefix_hit: float = 0.0  # the fraction of each prompt the prefix cache holds
    rate: float | None = None  # requests/s; None: find each layout's highest within the SLO
    num_requests: int | None = None  # a finite run of this many requests (finite_run.py); None: steady state

    def __post_init__(self) -> None:
        if self.isl < 1 or self.osl < 1:
            raise ValueError(f"--isl and --osl must be at least 1, got {self.isl} and {self.osl}")
        if not 0 <= self.prefix_hit < 1:
            raise ValueError(f"--prefix-hit must be in [0, 1), got {self.prefix_hit}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be positive (requests/s), got {self.rate}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {self.num_requests}")

    @property
    def num_cached_tokens(self) -> int:
        return int(self.isl * self.prefix_hit)

    @property
    def num_new_tokens(self) -> int:
        return self.isl - self.num_cached_tokens


@dataclass(frozen=True, kw_only=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"--ttft-slo and --tpot-slo must be positive, got {self.ttft_s} and {self.tpot_s}")


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    max_workers: int = 16
    one_host: bool = False  # every worker on the profiled machine, sharing its cores
    transport: str | None = None  # the KV transport of disaggregated layouts (default: grpc if profiled, else any)
    max_num_seqs: tuple[int, ...] = ()  # candidates (default: SEQ_CANDIDATES and the profile's, within KV capacity)
    client_cores: float = 0.0  # with one_host: cores the load generator keeps busy on the same machine
    serving_overhead_s: float | None = None  # what serving adds to TTFT (None: the profile's measurement, or 0)
    loaded_costs: bool = True  # with one_host: price the profile's loaded probe's stage costs (loaded.py)

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"--max-workers must be at least 1, got {self.max_workers}")
        if not self.client_cores >= 0:
            raise ValueError(f"--client-cores must be >= 0, got {self.client_cores}")
        if self.serving_overhead_s is not None and not self.serving_overhead_s >= 0:
            raise ValueError(f"--serving-overhead-s must be >= 0, got {self.serving_overhead_s}")


@dataclass(frozen=True, kw_only=True)
class Layout:
    num_colocated: int = 0
    num_prefill: int = 0
    num_decode: int = 0
    max_num_seqs: int
    prefill_threshold_tokens: int = 0  # --disagg-prefill-threshold (disaggregated only)
    transport: str | None = None
    # tensor-parallel sizes: the colocated pool's (`tp`), the prefill and decode pools' (disaggregated)
    tp: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def colocated(self) -> bool:
        return self.num_colocated > 0

    @property
    def num_workers(self) -> int:
        return self.num_colocated + self.num_prefill + self.num_decode

    @property
    def num_ranks(self) -> int:
        """Rank processes (devices, on a GPU) all pools together: a worker of tensor-parallel size N is N."""
        return self.num_colocated * self.tp + self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def prefill_pool_tp(self) -> int:
        """The tensor-parallel size prompts are prefilled at (the colocated pool's, or the prefill pool's)."""
        return self.tp if self.colocated else self.prefill_tp

    @property
    def decode_pool_tp(self) -> int:
        return self.tp if self.colocated else self.decode_tp

    @property
    def label(self) -> str:
        def sized(text: str, tp: int) -> str:
            return f"{text}(TP{tp})" if tp > 1 else text

        if self.colocated:
            return f"{sized('colocated', self.tp)} x{self.num_colocated}, seqs {self.max_num_seqs}"
        threshold = f", local<={self.prefill_threshold_tokens}" if self.prefill_threshold_tokens else ""
        return (f"{sized(f'{self.num_prefill}P', self.prefill_tp)}+{sized(f'{self.num_decode}D', self.decode_tp)}, "
                f"seqs {self.max_num_seqs}{threshold}")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    layout: Layout
    rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    goodput: float  # requests/s meeting both SLOs
    meets: bool
    stable: bool
    binding: str  # what limits it: "ttft", "tpot", "prefill capacity", "decode capacity", "host cores" (the
    # background takes them all), or "" when it meets
    max_rate: float | None = None  # the highest rate within the SLO (rate omitted)
    num_requests: int | None = None  # a finite run's length (None: steady state)
    num_refused: float = 0.0  # a finite run: requests the gateway's admission queue refuses (the mean)
    stages: dict[str, float] = dataclasses.field(default_factory=dict)  # a finite run: mean seconds of each TTFT
    # stage the gateway times (finite_run.FiniteRun.stages)

    def to_json(self) -> dict:
        def finite(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else round(x, 6)

        return {"layout": {**dataclasses.asdict(self.layout), "label": self.layout.label,
                           "num_workers": self.layout.num_workers, "num_ranks": self.layout.num_ranks,
                           "kind": "colocated" if self.layout.colocated else "disaggregated"},
                "rate": finite(self.rate), "ttft_p50_s": finite(self.ttft_p50_s), "ttft_p90_s": finite(self.ttft_p90_s),
                "tpot_p50_s": finite(self.tpot_p50_s), "tpot_p90_s": finite(self.tpot_p90_s),
                "goodput": finite(self.goodput), "meets_slo": self.meets, "stable": self.stable,
                "binding": self.binding, "max_rate": finite(self.max_rate), "num_requests": self.num_requests,
                "num_refused": round(self.num_refused, 3)}


@dataclass(frozen=True, kw_only=True)
class Plan:
    ranked: tuple[Prediction, ...]  # meeting layouts first (best first), then the rest, closest first
    traffic: Traffic
    slo: SLO
    problem: str = ""  # non-empty when no layout meets the SLO: the closest one and what binds

    @property
    def best(self) -> Prediction:
        return self.ranked[0]

    @property
    def met(self) -> bool:
        return bool(self.ranked) and self.ranked[0].meets


def host_share_slowdown(profile: Profile, num_workers: int, phase: str, *, num_ranks: int | None = None,
                        tp: int = 1) -> float:
    """How many times slower `phase` runs on each of `num_workers` workers sharing the profiled machine's cores,
    each with cpu_count // num_workers threads (at least 1) as `serve` gives them, than on the profile's threads:

        threads each k >= profiled N  ->  1
        k = 1, measured (profile.one_thread)  ->  that ratio;  1 < k < N  ->  ratio ** (log(N/k) / log N)
        not measured  ->  N / k (linear scaling: an upper bound)
        and x num_workers * k / cpu_count beyond the cores (more workers than cores time-share them)

    With tensor parallelism `serve` splits the cores between every rank (`num_ranks` of them): a worker of size
    `tp` holds tp x (cpu_count // num_ranks) threads, which its size's profiled ratio (measured on the profile's
    threads, split between its ranks) then scales from."""
    ranks = num_ranks or num_workers
    threads = max(1, profile.cpu_count // max(1, ranks)) * tp
    profiled = profile.num_threads
    scale = 1.0
    if threads < profiled:
        ratio = profile.one_thread.get(phase)
        if ratio is None:
            scale = profiled / threads
        else:
            scale = max(1.0, ratio) ** (math.log(profiled / threads) / math.log(profiled))
    return scale * max(1.0, ranks * (threads // tp) / profile.cpu_count)


def contention_slowdown(profile: Profile, phase: str, background_cores: float, threads: int) -> float:
    """How many times slower `phase` runs on a worker of `threads` threads while other processes keep
    `background_cores` of the profiled machine's cpu_count cores busy (inf at or beyond all of them):

        measured (profile.contention[phase], on num_threads) and threads >= num_threads  ->  piecewise linear
            through (0, 1) and the points (each held at least 1 and at least the one before), and beyond the last
            point that point's slowdown x the analytic curve's growth from it
        otherwise  ->  analytic: cores / (cores - background), each thread losing its share of what the
            background takes (an OpenMP team waiting at its barriers for a descheduled thread loses more: what
            the measured curve shows)

    Never below 1, never lower for more background."""
    if background_cores <= 0:
        return 1.0
    cores = profile.cpu_count
    if background_cores >= cores:
        return math.inf

    def analytic(b: float) -> float:
        return cores / (cores - b)

    points = profile.contention.get(phase, ())
    if not points or threads < profile.num_threads:
        return analytic(background_cores)
    xs, ys = [0.0], [1.0]
    for point in points:
        if point.background_cores > xs[-1] and point.background_cores < cores:
            xs.append(point.background_cores)
            ys.append(max(ys[-1], point.slowdown))
    if background_cores >= xs[-1]:
        return ys[-1] * analytic(background_cores) / analytic(xs[-1])
    i = next(k for k in range(1, len(xs)) if background_cores <= xs[k])
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (background_cores - xs[i - 1]) / (xs[i] - xs[i - 1])


def _unstable(layout: Layout, rate: float, binding: str) -> Prediction:
    """A layout that cannot keep up at `rate`, `binding` saying why: every latency infinite, no goodput."""
    inf = math.inf
    return Prediction(layout=layout, rate=rate, ttft_p50_s=inf, ttft_p90_s=inf, tpot_p50_s=inf, tpot_p90_s=inf,
                      goodput=0.0, meets=False, stable=False, binding=binding)


class LayoutModel:
    """A layout's costs on a profile and traffic; `predict` prices it at one rate."""

    def __init__(self, profile: Profile, traffic: Traffic, layout: Layout, options: PlanOptions) -> None:
        self.profile, self.traffic, self.layout, self.options = profile, traffic, layout, options
        n, c = traffic.num_new_tokens, traffic.num_cached_tokens
        self.local = (not layout.colocated) and n <= layout.prefill_threshold_tokens
        # A prompt prefilled locally (under the threshold) runs on a decode worker, at its size.
        prefill_tp = layout.decode_pool_tp if self.local else layout.prefill_pool_tp
        per_rank = max(1, profile.cpu_count // max(1, layout.num_ranks))
        self.threads = per_rank * layout.decode_pool_tp  # a decode (or colocated) worker's, all its ranks
        self.prefill_threads = per_rank * prefill_tp
        serving = profile.serving
        self.serving_overhead_s = (options.serving_overhead_s if options.serving_overhead_s is not None
                                   else serving.ttft_overhead_s if serving is not None else 0.0)
        # The step overhead was measured on one worker holding all the profile's threads, where its own gRPC and
        # stream threads and the gateway compete with its OpenMP team; on one host, a worker given fewer threads
        # leaves them a core.
        measured_alike = self.threads >= profile.num_threads or not options.one_host
        self.step_overhead_s = serving.step_overhead_s if serving is not None and measured_alike else 0.0
        # Each pool's tensor-parallel size scales its compute by what the profile measured at that size.
        self.prefill_slowdown = profile.tp_scale(prefill_tp, "prefill")
        self.decode_slowdown = profile.tp_scale(layout.decode_pool_tp, "decode")
        if options.one_host:
            self.prefill_slowdown *= host_share_slowdown(profile, layout.num_workers, "prefill",
                                                         num_ranks=layout.num_ranks, tp=prefill_tp)
            self.decode_slowdown *= host_share_slowdown(profile, layout.num_workers, "decode",
                                                        num_ranks=layout.num_ranks, tp=layout.decode_pool_tp)
        budget = int(profile.engine.get("max_num_batched_tokens") or n) or n
        self.num_chunks = max(1, math.ceil(n / budget))
        self.intercept_s = self.prefill_slowdown * profile.prefill.intercept_s
        self.prefill_s = (self.prefill_slowdown * profile.prefill.seconds(n, c)
                          + self.intercept_s * (self.num_chunks - 1))
        self.prompts_per_step = max(1, budget // max(1, n))
        self.ctx = traffic.isl + traffic.osl / 2
        block_size = profile.kv.block_size
        seq_blocks = math.ceil((traffic.isl + traffic.osl) / block_size)
        self.num_kv_blocks = profile.num_kv_blocks(layout.decode_pool_tp)  # each decode (or colocated) worker's
        self.slots = min(layout.max_num_seqs, self.num_kv_blocks // max(1, seq_blocks))
        prompt_bytes = math.ceil(traffic.isl / block_size) * profile.kv.block_bytes
        self.handoff_s = 0.0
        if not layout.colocated and not self.local:
            self.handoff_s = profile.handoff[layout.transport].fit.seconds(prompt_bytes) if layout.transport else 0.0
        # With --one-host, the stage costs a loaded `serve` of this kind of layout measured (loaded.py), or None.
        self.loaded: LoadedCosts | None = loaded_costs(profile, layout, options) if not self.local else None

    def handoff_at(self, rate: float) -> float:
        """The KV handoff of one prompt at `rate` (the profile's transport fit, plus what a loaded serve adds)."""
        if self.handoff_s == 0.0 or self.loaded is None:
            return self.handoff_s
        return self.handoff_s + self.loaded.at(rate).handoff_extra_s

    def serving_overhead_at(self, rate: float) -> float:
        """What serving adds to TTFT at `rate` (the probe's serving overhead, plus what a loaded serve adds)."""
        return self.serving_overhead_s + (0.0 if self.loaded is None else self.loaded.at(rate).overhead_s)

    def background_cores(self, rate: float) -> float:
        """With --one-host: the cores the gateway (its measured CPU per request and per token) and the load
        generator (--client-cores) keep busy beside the workers at `rate`; 0 otherwise."""
        if not self.options.one_host:
            return 0.0
        serving, osl = self.profile.serving, self.traffic.osl
        gateway = 0.0 if serving is None else rate * (serving.gateway_cpu_per_request_s
                                                      + osl * serving.gateway_cpu_per_token_s)
        return self.options.client_cores + gateway

    def contention(self, rate: float) -> tuple[float, float]:
        """(prefill, decode) slowdowns from the background cores at `rate` (1, 1 off one host)."""
        background = self.background_cores(rate)
        return (contention_slowdown(self.profile, "prefill", background, self.prefill_threads),
                contention_slowdown(self.profile, "decode", background, self.threads))

    def step_s(self, batch: float, factor: float = 1.0) -> float:
        return factor * self.decode_slowdown * self.profile.decode.seconds(batch, self.ctx) + self.step_overhead_s

    def _prefill_wait(self, servers: int, rate: float, factor: float = 1.0) -> tuple[Wait, float]:
        """The prefill queue and the service time (compute x `factor`), with the intercept shared by the prompts
        batched at load."""
        service = factor * self.prefill_s
        intercept = factor * self.intercept_s
        wait = mgc_wait(servers, rate, service)
        if wait.stable and self.prompts_per_step > 1:
            queued = erlang_c(servers, rate * service) * rate * service / max(1e-9, servers - rate * service)
            batched = min(self.prompts_per_step, 1 + queued / servers)
            service = service - intercept * (1 - 1 / batched)
            wait = mgc_wait(servers, rate, service)
        elif not wait.stable and self.prompts_per_step > 1:  # a full step's worth of prompts at once
            service = service - intercept * (1 - 1 / self.prompts_per_step)
            wait = mgc_wait(servers, rate, service)
        return wait, service

    def predict(self, rate: float, slo: SLO) -> Prediction:
        """The layout at `rate`: in steady state, or, with the traffic's num_requests, a finite run of them."""
        if self.traffic.num_requests is not None:
            return self.predict_finite(rate, slo, self.traffic.num_requests)
        return self.predict_steady(rate, slo)

    def predict_finite(self, rate: float, slo: SLO, num_requests: int) -> Prediction:
        """A run of `num_requests` at `rate` (finite_run.py): it meets the SLO when its completed requests' TTFT
        and TPOT p90s are within it and the gateway is expected to refuse none of them (fewer than half a request
        on average); past capacity it misses with binding "admission" when it refuses, else "ttft" or "tpot"."""
        run = simulate(self, rate, num_requests, ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s)
        meets_ttft, meets_tpot = run.ttft_p90_s <= slo.ttft_s, run.tpot_p90_s <= slo.tpot_s
        refuses = run.num_refused >= 0.5
        binding = "" if meets_ttft and meets_tpot and not refuses else "admission" if refuses else (
            "ttft" if run.ttft_p90_s / slo.ttft_s >= run.tpot_p90_s / slo.tpot_s else "tpot")
        return Prediction(layout=self.layout, rate=rate, ttft_p50_s=run.ttft_p50_s, ttft_p90_s=run.ttft_p90_s,
                          tpot_p50_s=run.tpot_p50_s, tpot_p90_s=run.tpot_p90_s, goodput=run.goodput,
                          meets=not binding, stable=math.isfinite(run.ttft_p90_s), binding=binding,
                          num_requests=num_requests, num_refused=run.num_refused, stages=run.stages)

    def predict_steady(self, rate: float, slo: SLO) -> Prediction:
        """The layout at `rate` in steady state (the module docstring's model)."""
        layout, osl = self.layout, self.traffic.osl
        prefilling_here = layout.colocated or self.local
        num_decode = layout.num_colocated or layout.num_decode
        prefill_servers = num_decode if prefilling_here else layout.num_prefill
        prefill_factor, decode_factor = self.contention(rate)
        if math.isinf(prefill_factor) or math.isinf(decode_factor):  # the background takes every core
            return _unstable(layout, rate, "host cores")
        wait, service = self._prefill_wait(prefill_servers, rate, prefill_factor)
        r = rate / num_decode  # per decode (or colocated) worker
        u_p = r * service if prefilling_here else 0.0  # the share of a worker's time its prompts take
        d = self.profile.decode
        scale = decode_factor * self.decode_slowdown
        a, b = scale * d.intercept_s + self.step_overhead_s, scale * (d.per_seq_s + d.per_seq_token_s * self.ctx)
        # B = r * osl * T, with T = (a + b B) / (1 - u_p): closed form for the batch each worker runs.
        denominator = 1 - u_p - r * osl * b
        unstable = not wait.stable or u_p >= 1 or denominator <= 0
        batch = r * osl * a / denominator if not unstable else math.inf
        slot_wait: Wait = NO_WAIT
        if batch > self.slots:  # full: requests wait for a slot, the batch stays at its cap
            batch = float(self.slots)
            life_s = osl * self.step_s(batch, decode_factor) / max(1e-9, 1 - u_p)
            slot_wait = mgc_wait(num_decode * self.slots, rate, life_s, cs2=1.0)
            unstable = unstable or not slot_wait.stable
        batch = max(batch, 1.0)
        if unstable:
            return _unstable(layout, rate, "prefill capacity" if (not wait.stable or u_p >= 1) else "decode capacity")
        step50 = self.step_s(batch, decode_factor)
        step90 = self.step_s(min(float(self.slots), poisson_quantile(batch)), decode_factor)
        # TPOT: decode steps plus, where prompts are prefilled here, the prefills a request sits through.
        stalls = r * osl * step50 / max(1e-9, 1 - u_p) if prefilling_here else 0.0
        tpot50 = step50 + stalls * service / osl
        tpot90 = step90 + (poisson_quantile(stalls) * service / osl if prefilling_here else 0.0)
        join_s = 0.0 if prefilling_here else self.handoff_at(rate) + step50 / 2
        fixed50 = service + join_s + (step50 if prefilling_here else 0.0) + self.serving_overhead_at(rate)
        ttft50 = wait.quantile(0.5) + slot_wait.quantile(0.5) + fixed50
        ttft90 = wait.quantile(0.9) + slot_wait.quantile(0.9) + fixed50 + (step90 - step50)
        p_ttft = 1 - min(1.0, wait.p_longer(slo.ttft_s - fixed50) + slot_wait.p_longer(slo.ttft_s - fixed50))
        sd = (tpot90 - tpot50) / 1.2816
        p_tpot = (1.0 if tpot50 <= slo.tpot_s else 0.0) if sd <= 0 else _normal_cdf((slo.tpot_s - tpot50) / sd)
        meets_ttft, meets_tpot = ttft90 <= slo.ttft_s, tpot90 <= slo.tpot_s
        binding = "" if meets_ttft and meets_tpot else (
            "ttft" if ttft90 / slo.ttft_s >= tpot90 / slo.tpot_s else "tpot")
        return Prediction(layout=layout, rate=rate, ttft_p50_s=ttft50, ttft_p90_s=ttft90, tpot_p50_s=tpot50,
                          tpot_p90_s=tpot90, goodput=rate * p_ttft * p_tpot, meets=meets_ttft and meets_tpot,
                          stable=True, binding=binding)

    def max_rate(self, slo: SLO) -> Prediction | None:
        """The prediction at the highest rate within the SLO (bisection: every cost grows with the rate); None
        when even a trickle misses it. A finite run's to 1% (each try simulates it), steady state's to 0.01%."""
        tolerance = 1e-2 if self.traffic.num_requests is not None else 1e-4
        low = 1e-6
        first = self.predict(low, slo)
        if not first.meets:
            return None
        high = 1.0
        while self.predict(high, slo).meets and high < 1e6:
            low, high = high, high * 2
        for _ in range(40):
            mid = (low + high) / 2
            if self.predict(mid, slo).meets:
                low = mid
            else:
                high = mid
            if high - low < tolerance * high:
                break
        return dataclasses.replace(self.predict(low, slo), max_rate=low)


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def layouts(profile: Profile, traffic: Traffic, options: PlanOptions) -> list[Layout]:
    """Every layout the search tries: colocated pools of 1..max_workers; disaggregated pools of P + D <= max_workers
    over the transport; each with every --max-num-seqs candidate (the profile's and SEQ_CANDIDATES, within the KV
    capacity); disaggregated with --disagg-prefill-threshold 0 (see below); each pool at every tensor-parallel size
    the profile measured, as long as the ranks (workers x their sizes) stay within max_workers."""
    seq_blocks = math.ceil((traffic.isl + traffic.osl) / profile.kv.block_size)
    if profile.kv.num_blocks // max(1, seq_blocks) < 1:
        raise ValueError(f"one request of {traffic.isl} + {traffic.osl} tokens needs {seq_blocks} KV blocks; the "
                         f"profiled worker holds {profile.kv.num_blocks}")

    def seqs(size: int) -> list[int]:
        """The --max-num-seqs candidates a worker of tensor-parallel size `size` holds the KV of."""
        kv_slots = profile.num_kv_blocks(size) // max(1, seq_blocks)
        return sorted({s for s in options.max_num_seqs or (*SEQ_CANDIDATES, profile.max_num_seqs) if s <= kv_slots}
                      or {max(1, kv_slots)})

    transport = options.transport or ("grpc" if "grpc" in profile.handoff else next(iter(profile.handoff), None))
    sizes = [size for size in profile.tensor_parallel_sizes if size <= options.max_workers]
    limit = options.max_workers
    out = [Layout(num_colocated=n, max_num_seqs=s, tp=t) for t in sizes for n in range(1, limit // t + 1)
           for s in seqs(t)]
    if transport is None:
        return out  # no handoff measured: disaggregated layouts cannot be priced
    # --disagg-prefill-threshold: with one prompt length every request falls on one side of it, so a threshold
    # at or above the new tokens makes the layout a colocated pool of D with P idle workers (priced, never better);
    # the search keeps 0 (always hand off). A mix of lengths is where it pays, and the traffic model has none yet.
    out += [Layout(num_prefill=p, num_decode=d, max_num_seqs=s, prefill_threshold_tokens=0, transport=transport,
                   prefill_tp=tp_p, decode_tp=tp_d)
            for tp_p in sizes for tp_d in sizes for p in range(1, limit // tp_p + 1)
            for d in range(1, (limit - p * tp_p) // tp_d + 1) for s in seqs(tp_d)]
    return out


def check_against_floor(profile: Profile, traffic: Traffic, slo: SLO, max_workers: int | None = None) -> None:
    """A ValueError when an SLO is below what one request alone takes on the profiled worker (no layout helps)."""
    sizes = [s for s in profile.tensor_parallel_sizes if max_workers is None or s <= max_workers]
    fastest = {phase: min(profile.tp_scale(size, phase) for size in sizes)
               for phase in ("prefill", "decode")}  # the best tensor-parallel size a layout may take
    prefill_s = fastest["prefill"] * profile.prefill.seconds(traffic.num_new_tokens, traffic.num_cached_tokens)
    if slo.ttft_s < prefill_s:
        raise ValueError(f"--ttft-slo {slo.ttft_s} s is below the profile's floor: a lone {traffic.isl}-token prompt "
                         f"({traffic.num_cached_tokens} cached) takes {prefill_s:.3f} s to prefill on the profiled "
                         "worker")
    step_s = fastest["decode"] * profile.decode.seconds(1, traffic.isl)
    if slo.tpot_s < step_s:
        raise ValueError(f"--tpot-slo {slo.tpot_s} s is below the profile's floor: one sequence's decode step at "
                         f"{traffic.isl} tokens takes {step_s:.4f} s on the profiled worker")
    if profile.max_model_len is not None and traffic.isl + traffic.osl > profile.max_model_len:
        raise ValueError(f"--isl {traffic.isl} + --osl {traffic.osl} exceeds the profiled max_model_len "
                         f"{profile.max_model_len}")


def plan(profile: Profile, traffic: Traffic, slo: SLO, options: PlanOptions = PlanOptions()) -> Plan:
    """Every layout priced, ranked: with a rate, the layouts meeting the SLO by fewest ranks (workers, at
    tensor-parallel size 1), then most goodput, then lowest TTFT p90, and the rest by how far they miss it; without
    one, the layouts by their highest rate within the SLO per rank, then by that rate. Raises ValueError for an SLO
    below the profile's floor or a transport it did not measure."""
    check_against_floor(profile, traffic, slo, options.max_workers)
    if options.transport is not None and options.transport not in profile.handoff:
        raise ValueError(f"--kv-transport {options.transport}: the profile measured "
                         f"{', '.join(profile.handoff) or 'no transport'}")
    models = [LayoutModel(profile, traffic, layout, options) for layout in layouts(profile, traffic, options)]
    if traffic.rate is not None:
        predictions = [m.predict(traffic.rate, slo) for m in models]
        meeting = sorted((p for p in predictions if p.meets),
                         key=lambda p: (p.layout.num_ranks, -p.goodput, p.ttft_p90_s, p.tpot_p90_s))
        missing = sorted((p for p in predictions if not p.meets), key=lambda p: (_miss(p, slo), p.layout.num_ranks))
        ranked = _one_per_pool_size([*meeting, *missing])
    else:
        found = [(m, m.max_rate(slo)) for m in models]
        meeting = sorted((p for _, p in found if p is not None),
                         key=lambda p: (-(p.max_rate or 0) / p.layout.num_ranks, -(p.max_rate or 0),
                                        p.layout.num_ranks))
        missing = sorted((m.predict(1e-6, slo) for m, p in found if p is None), key=lambda p: _miss(p, slo))
        ranked = _one_per_pool_size([*meeting, *missing])
    problem = "" if ranked and ranked[0].meets else _why_not(ranked[0], traffic, slo, options)
    return Plan(ranked=tuple(ranked), traffic=traffic, slo=slo, problem=problem)


def _one_per_pool_size(ranked: list[Prediction]) -> list[Prediction]:
    """The first (best) of each pool sizing: layouts that differ only in --max-num-seqs are one row."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in ranked:
        lay = p.layout
        key = (lay.num_colocated, lay.num_prefill, lay.num_decode, lay.tp, lay.prefill_tp, lay.decode_tp)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _miss(p: Prediction, slo: SLO) -> float:
    """How far a prediction misses the SLO: its worse p90 over its SLO (inf when its pools cannot keep up)."""
    if not p.stable:
        return math.inf
    return max(p.ttft_p90_s / slo.ttft_s, p.tpot_p90_s / slo.tpot_s)


def _why_not(closest: Prediction, traffic: Traffic, slo: SLO, options: PlanOptions) -> str:
    where = f"within {options.max_workers} workers" + (" on one host" if options.one_host else "")
    rate = f"at {traffic.rate} requests/s" if traffic.rate is not None else "at any rate"
    if not closest.stable:
        return (f"no layout {where} meets the SLO {rate}: even the closest ({closest.layout.label}) cannot keep up "
                f"(binding: {closest.binding})")
    if closest.binding == "ttft":
        detail = f"TTFT p90 {closest.ttft_p90_s:.3f} s > --ttft-slo {slo.ttft_s}"
    else:
        detail = f"TPOT p90 {closest.tpot_p90_s:.4f} s > --tpot-slo {slo.tpot_s}"
    return f"no layout {where} meets the SLO {rate}; the closest is {closest.layout.label}: {detail} (binding: " \
           f"{closest.binding})"


__all__ = ["Layout", "Plan", "PlanOptions", "Prediction", "SLO", "Traffic", "check_against_floor", "layouts", "plan"]
