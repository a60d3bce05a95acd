"""Kernel launches per step, from torch.profiler's CUDA activity: how many, which, and their summed device time.

    count = count_kernels(fn, device)    # fn runs one step (a graph replay, an eager forward, an engine step)

A kernel of a replayed CUDA graph counts as one launch like any other (the graph launches it). Memcpy and memset
activity is counted apart (`copies`), not as kernels. Kernels are grouped by name, their template arguments and
parameter lists cut off (`void at::native::elementwise_kernel<128, 4, ...>(...)` is `at::native::elementwise_kernel`;
Triton's and cuBLAS's names are kept whole). `KernelCountUnavailable` says why, where nothing can be counted (no
CUDA device, a torch without Kineto, a profiler that recorded no CUDA activity); the caller prints it and goes on.

CUPTI stays attached to the process after a profiler session unless Kineto tears it down (TEARDOWN_CUPTI=1, off by
default: pytorch/pytorch#144455), and an attached CUPTI slows the CUDA calls that follow (that issue: 10-20% of a
training step). `release_cupti()` detaches it once the counting is done, so that later timings in the process run
as in one that never counted.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from dataclasses import dataclass, field

import torch

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

TOP_GROUPS = 12
_cupti_started = False


class KernelCountUnavailable(RuntimeError):
    """The profiler cannot count kernels here; the message says why."""


@dataclass(frozen=True, kw_only=True)
class KernelCount:
    launches: int  # kernels run by the step (a graph's kernels included)
    kernel_us: float  # their device time, summed (kernels that overlap count twice)
    copies: int  # memcpy / memset activities
    groups: list[dict[str, object]] = field(default_factory=list)  # the top groups: name, count, us; most first

    def as_json(self) -> dict[str, object]:
        return {"launches": self.launches, "kernel_us": self.kernel_us, "copies": self.copies, "groups": self.groups}


def kernel_group(name: str) -> str:
    """A kernel's group: its name without `void `, template arguments and parameter list."""
    name = name.removeprefix("void ")
    for stop in ("<", "("):
        if stop in name:
            name = name[: name.index(stop)]
    return name.strip() or "?"


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def release_cupti() -> bool:
    """Detach CUPTI after `count_kernels` (module docstring): one empty profiler session that ends with Kineto's
    teardown (cuptiFinalize, on Kineto's thread at the next CUDA call). True if it was released; False where nothing
    was counted, TEARDOWN_CUPTI is set to something else (the caller's choice), or the CUDA version is one where a
    process with CUDA graphs crashes when CUPTI comes back after a teardown (< 12.6: torch keeps CUPTI attached there
    for the same reason, torch/profiler/profiler.py). A later `count_kernels` attaches it again."""
    global _cupti_started
    if not _cupti_started or os.environ.get("TEARDOWN_CUPTI", "1") != "1":
        return False
    from torch.profiler import ProfilerActivity, profile
    from torch.torch_version import TorchVersion

    cuda = torch.version.cuda
    if cuda is None or TorchVersion(cuda) < "12.6":
        return False
    previous = os.environ.get("TEARDOWN_CUPTI")
    os.environ["TEARDOWN_CUPTI"] = "1"  # Kineto reads it when a session stops
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            torch.cuda.synchronize()
        torch.cuda.synchronize()  # a CUDA call: the teardown finalizes CUPTI in its exit callback
    finally:
        if previous is None:
            del os.environ["TEARDOWN_CUPTI"]
        else:
            os.environ["TEARDOWN_CUPTI"] = previous
    _cupti_started = False  # the next count warms a new CUPTI up first
    return True


def count_kernels(fn: Callable[[], object], device: torch.device, *, top: int = TOP_GROUPS) -> KernelCount:
    """Run `fn` once under torch.profiler and count the CUDA kernels it ran on `device`'s GPU."""
    if device.type != "cuda":
        raise KernelCountUnavailable(f"kernel counts need CUDA activity; the device is {device}")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.profiler.kineto_available():
        raise KernelCountUnavailable("this torch has no Kineto: torch.profiler records no CUDA activity")
    global _cupti_started
    torch.cuda.synchronize(device)
    if not _cupti_started:  # the first session starts CUPTI: an empty one, so that no counted session is the first
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            torch.cuda.synchronize(device)
        _cupti_started = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    activity = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not activity:
        raise KernelCountUnavailable("the profiler recorded no CUDA activity (CUPTI unavailable, or in use elsewhere?)")
    return tally(activity, top=top)


def tally(activity: Iterable[tuple[str, float]], *, top: int = TOP_GROUPS) -> KernelCount:
    """(name, device us) of each CUDA activity the profiler recorded -> the count: kernels grouped, copies apart."""
    counts: Counter[str] = Counter()
    times_us: defaultdict[str, float] = defaultdict(float)
    copies = 0
    for name, us in activity:
        if _is_copy(name):
            copies += 1
            continue
        group = kernel_group(name)
        counts[group] += 1
        times_us[group] += us
    ranked = sorted(counts, key=lambda g: (-counts[g], -times_us[g], g))
    return KernelCount(
        launches=sum(counts.values()),
        kernel_us=sum(times_us.values()),
        copies=copies,
        groups=[{"name": g, "count": counts[g], "us": round(times_us[g], 2)} for g in ranked[:top]],
    )


def describe(label: str, count: KernelCount, *, top: int = 6) -> str:
    """One printed line: launches, device time, the largest groups."""
    groups = ", ".join(f"{g['count']} x {str(g['name'])[:48]}" for g in count.groups[:top])
    return (f"  {label}: {count.launches} kernels, {count.kernel_us / 1e3:.3f} ms of kernels, {count.copies} copies"
            f" | {groups}")


def count_step_kernels(engine: LLMEngine, batch: int, step: Callable[[], None]) -> dict[str, Any]:
    """Kernels of one decode step at `batch` (module docstring), label -> KernelCount.as_json(), printed as they come;
    {"unavailable": why} where the profiler cannot count, {"error": ...} for a probe that failed (the decode row
    keeps its figures either way). The eager probes rerun the last replayed step's inputs, as the replay timing
    does; the engine step is one more step of the batch."""
    device = engine.device
    graphs = getattr(engine.runner, "graphs", None)
    bucket = graphs.bucket(batch) if graphs is not None else None
    probes: dict[str, Callable[[], object]] = {}
    if graphs is not None and bucket is not None:
        probes["graph_replay"] = lambda: graphs._replay(bucket)
        probes["eager_forward"] = lambda: graphs._step(bucket)
        model = graphs.model
        if getattr(model, "rotary_in_attention", False):

            def unfused() -> object:
                model.rotary_in_attention = False
                try:
                    return graphs._step(bucket)
                finally:
                    model.rotary_in_attention = True

            probes["eager_forward_rotary_unfused"] = unfused
    probes["engine_step"] = step
    print(f"kernels a step at batch {batch}:", flush=True)
    counts: dict[str, Any] = {}
    for label, probe in probes.items():
        try:
            count: KernelCount = count_kernels(probe, device)
        except KernelCountUnavailable as why:  # nothing to count: say why (once, where the first probe says it)
            print(f"  {label}: not counted: {why}", flush=True)
            if not counts:
                return {"unavailable": str(why)}
            counts[label] = {"unavailable": str(why)}
            continue
        except Exception as exc:  # noqa: BLE001 - a figure lost, not the run
            traceback.print_exc()
            counts[label] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {label}: not counted: {counts[label]['error']}", flush=True)
            continue
        counts[label] = count.as_json()
        print(describe(label, count), flush=True)
    # The profiler's CUPTI would otherwise stay attached and slow every later step timed in this process.
    print(f"  CUPTI {'detached' if release_cupti() else 'left attached'} after counting", flush=True)
    return counts


def kernel_row(shape: str, decode: dict) -> str:
    k = decode["kernels"]

    def launches(label: str) -> str:
        return str(k[label]["launches"]) if "launches" in k.get(label, {}) else "-"

    step = k["engine_step"]
    step_cell = f"{step['launches']} (+{step['copies']})" if "launches" in step else "-"
    replay_ms = f"{k['graph_replay']['kernel_us'] / 1e3:.3f}" if "launches" in k.get("graph_replay", {}) else "-"
    return (f"| {shape} | {decode['batch']} | {launches('graph_replay')} | {launches('eager_forward')} | "
            f"{launches('eager_forward_rotary_unfused')} | {step_cell} | {replay_ms} |")
