"""The profile's loaded probe: a real `splitserve serve` of one layout on this machine, driven by AIPerf at a few
Poisson rates, each run's TTFT stages read off the gateway's ttft_stage_seconds histograms (what `plan --one-host`
prices under load: loaded.py). Torch-free; AIPerf is found as `splitserve bench` finds it (no dependency).

    measure_loaded(profile, layout, rates, num_requests, isl, osl) -> Loaded

Per rate: the gateway's histograms scraped before and after one AIPerf run of `num_requests` requests (`splitserve
bench`'s random workload: prompts of `isl` tokens, `osl` output tokens with ignore_eos, streamed, each run its own
seed so that no run hits an earlier one's prefix cache), the means of each stage between the scrapes, the client's
TTFT mean and inter-token p50, and the whole machine's busy cores while its requests ran (/proc/stat sampled 4
times a second, between AIPerf's start and end times: what else ran is in it, AIPerf's start-up is not). A warm-up
of 4 requests at concurrency 1 goes first (the first requests pay one-time costs).
"""

from __future__ import annotations

import datetime
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from deploy.planner.profile import Loaded, LoadedPoint, Profile

if TYPE_CHECKING:
    from deploy.planner.planner import Layout

STAGES = ("router_queue", "prefill_queue", "prefill", "kv_transfer")
T = TypeVar("T")


def aiperf_epoch_s(local_iso: object) -> float:
    """AIPerf's start_time / end_time (local time, no zone) as seconds since the epoch (nan when absent)."""
    try:
        return datetime.datetime.fromisoformat(str(local_iso)).timestamp()
    except ValueError:
        return math.nan


def host_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat's cpu line: all but idle and iowait)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # to steal; less idle, iowait


class Sampler(threading.Thread, Generic[T]):
    """`sample()` 4 times a second, with the wall-clock time, until the `with` block ends (`samples`); `window(t0,
    t1)`: those taken between two wall-clock times (AIPerf's start and end of its requests: its start-up left out)."""

    def __init__(self, sample: Callable[[], T], *, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.sample, self.period_s = sample, period_s
        self.samples: list[tuple[float, T]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.samples.append((time.time(), self.sample()))
            self._done.wait(self.period_s)

    def __enter__(self) -> Sampler[T]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()

    def window(self, start_s: float, end_s: float) -> list[tuple[float, T]]:
        return [(t, value) for t, value in self.samples if start_s <= t <= end_s]


def busy_cores(sampler: Sampler[float], start_s: float, end_s: float) -> float:
    """The machine's busy cores between two wall-clock times, from a Sampler of `host_busy_s` (0: too few samples)."""
    window = sampler.window(start_s, end_s)
    if len(window) < 2 or window[-1][0] <= window[0][0]:
        return 0.0
    return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])


def default_rates(profile: Profile, *, isl: int, fractions: Sequence[float] = (0.25, 0.5)) -> list[float]:
    """Rates for a 1P+1D probe: `fractions` of what its prefill worker (one thread of a 2-worker host, as serve
    splits the cores) can prefill at most, one prompt at a time, rounded to 0.05 requests/s."""
    from deploy.planner.planner import host_share_slowdown

    prefill_s = profile.prefill.seconds(isl) * host_share_slowdown(profile, 2, "prefill")
    return [max(0.05, round(f / prefill_s / 0.05) * 0.05) for f in fractions]


def measure_loaded(profile: Profile, layout: Layout, *, rates: Sequence[float], num_requests: int, isl: int, osl: int,
                   log: Callable[[str], None] = print, seed: int = 100, url: str | None = None) -> Loaded:
    """Serve `layout` with the profile's engine flags, measure each rate (the module docstring), stop it; with
    `url`, measure the server there instead (which must serve `layout`). FileNotFoundError when AIPerf is not
    installed; RuntimeError when a run times no prefill stage."""
    from deploy.bench import stages
    from deploy.bench.aiperf_driver import aiperf_command, find_aiperf, run_aiperf
    from deploy.bench.report import run_from_summary
    from deploy.bench.tokenizer import aiperf_tokenizer
    from deploy.bench.workload import Workload, aiperf_flags
    from deploy.planner.render import serve_flags
    from deploy.planner.serving_probe import ServeProcess

    aiperf = find_aiperf()
    model = profile.model.name
    tokenizer, env = aiperf_tokenizer(model)
    workload = [*aiperf_flags(Workload(kind="random", isl=isl, osl=osl), num_requests=num_requests),
                "--request-timeout-seconds", "600"]

    def run(server_url: str, flags: list[str]) -> dict:
        with tempfile.TemporaryDirectory() as out:
            command = aiperf_command(aiperf, url=server_url, model=model, tokenizer=tokenizer,
                                     artifact_dir=Path(out), flags=[*workload, *flags])
            return run_aiperf(command, env=env, artifact_dir=Path(out))

    points = []
    server = None
    if url is None:
        server = ServeProcess(serve_flags(profile, layout))
        url = server.url
    try:
        run(url, ["--request-count", "4", "--concurrency", "1", "--random-seed", str(seed)])
        for i, rate in enumerate(rates):
            before = stages.scrape(url)
            with Sampler(host_busy_s) as sampler:
                summary = run(url, ["--request-rate", f"{rate:g}", "--request-count", str(num_requests),
                                    "--random-seed", str(seed + 1 + i)])
            busy = busy_cores(sampler, *(aiperf_epoch_s(summary.get(k)) for k in ("start_time", "end_time")))
            deltas = stages.stage_deltas(before, stages.scrape(url))
            measured = run_from_summary(summary, mode="rate", point=rate, seed=seed + 1 + i, command=[],
                                        stages=deltas)
            means = {s: (deltas.get(s) or {}).get("mean_s") or 0.0 for s in STAGES}
            if not means["prefill"]:
                raise RuntimeError(f"the loaded probe at {rate:g} req/s timed no prefill stage (histograms: "
                                   f"{sorted(deltas)})")
            points.append(LoadedPoint(
                rate=rate, num_requests=num_requests, ttft_mean_s=measured["ttft_s"]["avg"],
                router_queue_s=means["router_queue"], prefill_queue_s=means["prefill_queue"],
                prefill_s=means["prefill"], kv_transfer_s=means["kv_transfer"],
                tpot_p50_s=measured["tpot_s"]["p50"] or 0.0, host_busy_cores=busy))
            log(f"loaded probe at {rate:g} req/s: TTFT mean {points[-1].ttft_mean_s:.3f} s, prefill "
                f"{points[-1].prefill_s:.3f} s, KV transfer {points[-1].kv_transfer_s * 1e3:.1f} ms, router queue "
                f"{points[-1].router_queue_s:.3f} s; the host {points[-1].host_busy_cores:.2f} cores busy")
    finally:
        if server is not None:
            server.stop()
    return Loaded(num_colocated=layout.num_colocated, num_prefill=layout.num_prefill, num_decode=layout.num_decode,
                  max_num_seqs=layout.max_num_seqs, transport=layout.transport, isl=isl, osl=osl, client="aiperf",
                  points=tuple(points))
