"""`splitserve profile`'s measurements, with the real engine on this machine (imports torch).

    measure_prefill(engine, n, c)     one prompt of n new tokens after a cached prefix of c (c: whole blocks, which
                                      the prefix cache holds first), max_tokens 1: seconds from add to finish
    measure_decode(engine, B, ctx)    B sequences of ctx tokens decoding together: seconds per step (the fastest)
    measure_contention(engine, ...)   one prefill and one decode point again while `Burner` processes keep some
                                      cores busy: their slowdown against background cores (medians both ways)
    measure_handoff(...)              bench/handoff_cost.py's measure(), run as a subprocess per size: the real
                                      senders and receivers (a decode worker's reservation on a grpc.aio server
                                      in its own process; inproc in one), seconds against bytes per transport

Each point keeps its fastest measurement (of `repeats` prefills, of `decode_steps` steps): on a machine shared with
other work a median still swings by 10x (load 5 on 2 cores: a 1x256 decode step measured 80 ms and 1,200 ms in one
run), and the fastest is the worker's own cost, not its neighbours'. Prompts are random token ids from a seeded
generator, fresh for each point, so that no point hits another's cache.
The decode points share one prompt prefix of ctx - block_size tokens between the B sequences (each has its own
last block), so that reaching a context of 2,048 tokens costs one prefill, not B: the decode step still attends
over B x ctx tokens, but the shared blocks are read from one place (warm in the CPU's caches), which flatters large
batches a little. Every measurement leaves the engine with no request and no KV block in use (checked: a
RuntimeError otherwise).
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.planner.fit import fit_nonnegative
from deploy.planner.profile import (ContentionPoint, DecodeFit, DecodePoint, HandoffFit, HandoffPoint, KVCapacity,
                                    ModelIdentity, PrefillFit, PrefillPoint, Profile, TPScale, TransportProfile)

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

REPO_ROOT = Path(__file__).resolve().parents[2]
HANDOFF_BENCH = REPO_ROOT / "bench" / "handoff_cost.py"


@dataclass(frozen=True, kw_only=True)
class ProfileGrid:
    """What to measure: prefill (new, cached) pairs, decode (batch, context) pairs, handoff token counts."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    decode_steps: int
    handoff_tokens: tuple[int, ...]
    handoff_repeats: int
    repeats: int  # each prefill point's measurements (the fastest is kept)
    one_thread_prefill: tuple[int, int] = (256, 0)  # the points measured again on 1 thread (no cached prefix)
    one_thread_decode: tuple[int, int] = (8, 256)
    # background cores the contention points run under (each phase's one-thread point, on every thread)
    contention_cores: tuple[float, ...] = (0.5, 1.0)


QUICK_GRID = ProfileGrid(
    prefill=((32, 0), (256, 0), (1024, 0), (256, 768)),
    decode=((1, 256), (8, 256), (32, 256), (8, 1024)),
    decode_steps=6, handoff_tokens=(256, 1024), handoff_repeats=5, repeats=2)
FULL_GRID = ProfileGrid(
    prefill=((16, 0), (64, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (64, 512), (256, 768), (256, 1792),
             (512, 1536)),
    decode=((1, 128), (4, 128), (16, 128), (64, 128), (1, 1024), (8, 1024), (32, 1024), (64, 1024), (4, 2048),
            (16, 2048)),
    decode_steps=8, handoff_tokens=(128, 512, 2048), handoff_repeats=15, repeats=3)


class Progress:
    """A progress bar on stderr (tqdm) over `total` measurements, each named as it starts."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="profile", file=sys.stderr, disable=not enabled, unit="pt",
                         bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}] {postfix}")

    def start(self, what: str) -> None:
        self._bar.set_postfix_str(what)

    def done(self, result: str) -> None:
        self._bar.set_postfix_str(result)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _fresh_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # ids from 3 up: clear of the usual BOS/EOS/pad ids (it does not matter to the timing, only to readability)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def _check_idle(engine: LLMEngine, what: str) -> None:
    if engine.has_unfinished_requests() or engine.block_pool.num_used_blocks:
        raise RuntimeError(f"{what} left {engine.block_pool.num_used_blocks} KV blocks in use")


def _run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure_prefill(engine: LLMEngine, num_new_tokens: int, num_cached_tokens: int, rng: random.Random) -> float:
    """Seconds for one prompt of `num_new_tokens` after `num_cached_tokens` (a multiple of the block size, held by
    the prefix cache first) to prefill and sample its one token, alone on the engine."""
    from engine.request.sampling_params import SamplingParams

    block_size = engine.config.block_size
    if num_cached_tokens % block_size:
        raise ValueError(f"a cached prefix is whole blocks: {num_cached_tokens} is not a multiple of {block_size}")
    if num_cached_tokens and not engine.config.enable_prefix_caching:
        raise ValueError("cached-prefix points need --enable-prefix-caching")
    vocab = engine.model_config.vocab_size
    prefix = _fresh_tokens(rng, num_cached_tokens, vocab)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    if prefix:
        engine.add_request(f"warm-{rng.random()}", prefix + _fresh_tokens(rng, 1, vocab), one)
        _run_to_end(engine)
    prompt = prefix + _fresh_tokens(rng, num_new_tokens, vocab)
    started = time.perf_counter()
    engine.add_request(f"prefill-{rng.random()}", prompt, one)
    _run_to_end(engine)
    seconds = time.perf_counter() - started
    _check_idle(engine, "a prefill measurement")
    return seconds


def measure_decode(engine: LLMEngine, batch_size: int, context_len: int, num_steps: int, rng: random.Random) -> float:
    """The fastest of `num_steps` decode steps of `batch_size` sequences at about `context_len` tokens each (they share
    a cached prefix of context_len - block_size tokens; see the module docstring)."""
    from engine.request.sampling_params import SamplingParams

    if batch_size > engine.config.max_num_seqs:
        raise ValueError(f"a batch of {batch_size} needs --max-num-seqs >= {batch_size}")
    block_size, vocab = engine.config.block_size, engine.model_config.vocab_size
    shared = _fresh_tokens(rng, max(0, context_len - block_size), vocab)
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True)
    if shared and engine.config.enable_prefix_caching:
        engine.add_request(f"warm-{rng.random()}", shared + _fresh_tokens(rng, 1, vocab),
                           SamplingParams(max_tokens=1, temperature=0.0))
        _run_to_end(engine)
    for i in range(batch_size):
        engine.add_request(f"decode-{i}-{rng.random()}", shared + _fresh_tokens(rng, context_len - len(shared), vocab),
                           params)
    num_tokens: dict[str, int] = {}
    while len([n for n in num_tokens.values() if n >= 1]) < batch_size:  # every prompt in and its first token out
        for out in engine.step():
            num_tokens[out.request_id] = len(out.token_ids)
    times = []
    for _ in range(num_steps):
        started = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - started)
        if len(outs) != batch_size:
            raise RuntimeError(f"a decode step of {batch_size} sequences produced {len(outs)} outputs")
    _run_to_end(engine)
    _check_idle(engine, "a decode measurement")
    return min(times)


# A process that keeps `duty` of one core busy: spin for duty x 10 ms, sleep the rest, until killed.
_BURN = ("import sys, time\nduty = float(sys.argv[1])\nwhile True:\n    end = time.perf_counter() + duty * 0.01\n"
         "    while time.perf_counter() < end:\n        pass\n    time.sleep((1 - duty) * 0.01)\n")


class Burner:
    """Processes keeping `cores` cores busy (a whole one each, and a part of one for the fraction), as a load
    generator and a gateway would beside the worker; a context manager that kills them on exit."""

    def __init__(self, cores: float) -> None:
        duties = [1.0] * int(cores) + ([cores - int(cores)] if cores - int(cores) > 1e-6 else [])
        self._procs = [subprocess.Popen([sys.executable, "-c", _BURN, f"{d:.3f}"]) for d in duties]
        time.sleep(0.2)  # running before the timing starts

    def __enter__(self) -> Burner:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait(10)


def measure_contention(engine: LLMEngine, prefill_point: tuple[int, int], decode_point: tuple[int, int],
                       cores: Sequence[float], *, decode_steps: int, rng: random.Random) -> dict[str, list[tuple[
                           float, float]]]:
    """phase -> [(background cores, slowdown)]: the prefill of `prefill_point` (new, cached) and the decode step
    of `decode_point` (batch, context) under `Burner(c)` over the same alone, measured right before it. The fastest
    of each, as every point of the profile: a burner spinning in 10 ms periods slows every prefill and every step
    (so the fastest still shows it), while other work on a shared machine slows only some."""
    n, c = prefill_point
    b, ctx = decode_point

    def both() -> tuple[float, float]:
        return (min(measure_prefill(engine, n, c, rng) for _ in range(3)),
                measure_decode(engine, b, ctx, decode_steps, rng))

    out: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
    for background in cores:
        alone = both()
        with Burner(background):
            loaded = both()
        out["prefill"].append((background, loaded[0] / alone[0]))
        out["decode"].append((background, loaded[1] / alone[1]))
    return out


def measure_handoff(transports: Sequence[str], token_counts: Sequence[int], *, dtype: str, repeats: int,
                    timeout_s: float = 300.0) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """(transport -> [(bytes, p50 seconds)]) and (transport -> why it was not measured), by running
    bench/handoff_cost.py once per token count (SmolLM2-135M's KV shape in `dtype`; the time is a function of the
    bytes, which the planner computes from the profiled model's own layout)."""
    points: dict[str, list[tuple[int, float]]] = {t: [] for t in transports}
    skipped: dict[str, str] = {}
    if not HANDOFF_BENCH.exists():
        return {}, {t: f"{HANDOFF_BENCH} is not here (an installed package without the repository)"
                    for t in transports}
    for num_tokens in token_counts:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "handoff.json"
            command = [sys.executable, str(HANDOFF_BENCH), "--transports", ",".join(transports), "--num-tokens",
                       str(num_tokens), "--repeats", str(repeats), "--warmup", "2", "--dtype", dtype, "--json",
                       str(out)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False,
                                    env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                        [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
            if not out.exists():
                reason = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
                return {}, {t: f"bench/handoff_cost.py failed: {reason[0]}" for t in transports}
            report = json.loads(out.read_text(encoding="utf-8"))
        for summary in report["transports"]:
            name = summary["transport"]
            if summary.get("problems") or not summary.get("num_handoffs"):
                skipped[name] = "; ".join(summary.get("problems") or ["no handoff completed"])
                continue
            points[name].append((int(report["num_bytes"]), summary["total_p50_ms"] / 1e3))
    return {t: p for t, p in points.items() if p and t not in skipped}, skipped


def _versions() -> dict[str, Any]:
    from importlib import metadata

    import torch

    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("splitserve", "grpcio"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    try:
        versions["git_commit"] = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                                                text=True, timeout=10, check=False).stdout.strip() or None
    except OSError:
        versions["git_commit"] = None
    return versions


def _machine(engine: LLMEngine) -> dict[str, Any]:
    import torch

    device = engine.device
    return {
        "cpu_count": len(os.sched_getaffinity(0)),
        "num_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "platform": platform.platform(),
    }


def _measure_tensor_parallel(engine: LLMEngine, config: EngineConfig, sizes: Sequence[int],
                             prefill_point: tuple[int, int], decode_point: tuple[int, int], grid: ProfileGrid,
                             rng: random.Random, progress: Progress) -> dict[int, TPScale]:
    """Each size's prefill and decode point against `engine`'s (size 1, on torch's threads), an engine at that size
    built with those threads split between its ranks (at least one each), then closed."""
    import dataclasses

    import torch

    from engine.llm_engine import LLMEngine

    if not sizes:
        return {}
    threads = torch.get_num_threads()
    (n, c), (b, ctx) = prefill_point, decode_point
    base = (min(measure_prefill(engine, n, c, rng) for _ in range(2)),
            measure_decode(engine, b, ctx, grid.decode_steps, rng))
    scales = {}
    for size in sizes:
        per_rank = max(1, threads // size)
        progress.start(f"prefill and decode at tensor-parallel size {size} ({per_rank} thread(s) a rank)")
        wide = None
        try:
            wide = LLMEngine(dataclasses.replace(config, tensor_parallel_size=size, num_threads=per_rank))
            measure_prefill(wide, min(64, n), 0, rng)  # its first-call costs out of the figures
            at = (min(measure_prefill(wide, n, c, rng) for _ in range(2)),
                  measure_decode(wide, b, ctx, grid.decode_steps, rng))
            num_kv_blocks = wide.num_kv_blocks
        finally:
            if wide is not None:
                wide.close()
            torch.set_num_threads(threads)  # building it set this process' threads to its rank 0's
        scales[size] = TPScale(prefill=at[0] / base[0], decode=at[1] / base[1], threads_per_rank=per_rank,
                               num_kv_blocks=num_kv_blocks)
        progress.done(f"TP {size}: prefill x{scales[size].prefill:.2f}, decode x{scales[size].decode:.2f}")
    return scales


def run_profile(config: EngineConfig, *, quick: bool, transports: Sequence[str] = ("grpc", "inproc"),
                seed: int = 0, show_progress: bool = True,
                grid: ProfileGrid | None = None, log: Callable[[str], None] | None = None,
                tensor_parallel_sizes: Sequence[int] = ()) -> Profile:
    """Measure one engine built from `config` over `grid` (QUICK_GRID or FULL_GRID by `quick`) and the handoffs
    over `transports` (none: skipped); return the profile with its fitted curves. `tensor_parallel_sizes` (each
    >= 2; `config` at size 1): an engine at each size, on the same threads split between its ranks, times the
    one-thread points too, against size 1's (the profile's `tensor_parallel`)."""
    import dataclasses
    import datetime

    import torch

    from engine.llm_engine import LLMEngine

    started = time.perf_counter()
    grid = grid or (QUICK_GRID if quick else FULL_GRID)
    largest_batch = max(b for b, _ in grid.decode)
    given_max_num_seqs = config.max_num_seqs  # what serve would run with; the profile's engine takes the grid's
    config = dataclasses.replace(config, max_num_seqs=max(config.max_num_seqs, largest_batch))
    sizes = sorted(set(tensor_parallel_sizes))
    if sizes and (sizes[0] < 2 or config.tensor_parallel_size != 1):
        raise ValueError(f"--tensor-parallel-sizes: sizes >= 2 measured against an engine at size 1, got {sizes} "
                         f"against size {config.tensor_parallel_size}")
    engine = LLMEngine(config)
    from engine.distributed.sharding import tp_shape

    for size in sizes:  # one clear error naming the model's heads, before minutes of measuring
        tp_shape(engine.model_config, size)
    longest = engine.max_model_len
    block_size = engine.config.block_size
    prefill_grid = [(n, c - c % block_size) for n, c in grid.prefill
                    if n + c < longest and (c == 0 or engine.config.enable_prefix_caching)]
    decode_grid = [(b, ctx) for b, ctx in grid.decode if ctx + grid.decode_steps + 2 < longest]
    num_points = (len(prefill_grid) * grid.repeats + len(decode_grid) + len(grid.handoff_tokens) * bool(transports)
                  + (torch.get_num_threads() > 1) + len(grid.contention_cores) + len(sizes))
    progress = Progress(num_points + 1, enabled=show_progress)
    rng = random.Random(seed)
    try:
        progress.start("warm-up")
        measure_prefill(engine, min(64, longest // 2), 0, rng)
        progress.done("warm-up done")
        prefill_points = []
        for n, c in prefill_grid:
            runs = []
            for _ in range(grid.repeats):
                progress.start(f"prefill {n} new + {c} cached tokens")
                runs.append(measure_prefill(engine, n, c, rng))
                progress.done(f"prefill {n}+{c}: {runs[-1]:.3f} s")
            prefill_points.append(PrefillPoint(num_new_tokens=n, num_cached_tokens=c, seconds=min(runs)))
        decode_points = []
        for b, ctx in decode_grid:
            progress.start(f"decode batch {b} at {ctx} tokens")
            seconds = measure_decode(engine, b, ctx, grid.decode_steps, rng)
            decode_points.append(DecodePoint(batch_size=b, context_len=ctx, seconds=seconds))
            progress.done(f"decode {b}x{ctx}: {seconds * 1e3:.1f} ms/step")
        one_thread = {}
        if torch.get_num_threads() > 1:  # the same points on 1 thread: what sharing the cores costs each phase
            threads = torch.get_num_threads()
            n, c = min(grid.one_thread_prefill[0], longest // 2), 0
            b, ctx = min(grid.one_thread_decode[0], engine.config.max_num_seqs), min(grid.one_thread_decode[1],
                                                                                   longest // 2)
            progress.start(f"prefill and decode on 1 thread (of {threads})")
            many = (min(measure_prefill(engine, n, c, rng) for _ in range(2)),
                    measure_decode(engine, b, ctx, grid.decode_steps, rng))
            torch.set_num_threads(1)
            try:
                one = (min(measure_prefill(engine, n, c, rng) for _ in range(2)),
                       measure_decode(engine, b, ctx, grid.decode_steps, rng))
            finally:
                torch.set_num_threads(threads)
            one_thread = {"prefill": one[0] / many[0], "decode": one[1] / many[1]}
            progress.done(f"1 thread: prefill x{one_thread['prefill']:.2f}, decode x{one_thread['decode']:.2f}")
        contention: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
        n, c = min(grid.one_thread_prefill[0], longest // 2), 0
        b, ctx = min(grid.one_thread_decode[0], engine.config.max_num_seqs), min(grid.one_thread_decode[1],
                                                                               longest // 2)
        for background in grid.contention_cores:
            progress.start(f"prefill and decode beside {background:g} busy cores")
            measured = measure_contention(engine, (n, c), (b, ctx), [background], decode_steps=grid.decode_steps,
                                          rng=rng)
            for phase, points in measured.items():
                contention[phase] += points
            progress.done(f"{background:g} busy cores: prefill x{measured['prefill'][0][1]:.2f}, "
                          f"decode x{measured['decode'][0][1]:.2f}")
        tensor_parallel = _measure_tensor_parallel(engine, config, sizes, (n, c), (b, ctx), grid, rng, progress)
        handoff_points: dict[str, list[tuple[int, float]]] = {}
        skipped: dict[str, str] = {}
        if transports:
            progress.start(f"KV handoffs over {', '.join(transports)}")
            handoff_dtype = "float32" if engine.device.type == "cpu" else "bfloat16"
            handoff_points, skipped = measure_handoff(transports, grid.handoff_tokens, dtype=handoff_dtype,
                                                      repeats=grid.handoff_repeats)
            for _ in grid.handoff_tokens:
                progress.done(f"handoffs: {', '.join(handoff_points) or 'none'}")
    finally:
        progress.close()
    prefill_fit = PrefillFit.of(*fit_nonnegative([PrefillFit.features(p.num_new_tokens, p.num_cached_tokens)
                                                for p in prefill_points], [p.seconds for p in prefill_points]))
    decode_fit = DecodeFit.of(*fit_nonnegative([DecodeFit.features(p.batch_size, p.context_len) for p in decode_points],
                                            [p.seconds for p in decode_points]))
    handoff = {}
    for name, pts in handoff_points.items():
        if len(pts) >= 2:
            intercept, per_byte = fit_nonnegative([(1.0, float(b)) for b, _ in pts], [s for _, s in pts])
        else:
            intercept, per_byte = 0.0, pts[0][1] / pts[0][0]
        handoff[name] = TransportProfile(points=tuple(HandoffPoint(num_bytes=b, seconds=s) for b, s in pts),
                                         fit=HandoffFit(intercept_s=intercept, per_byte_s=per_byte))
    resolved = engine.config
    engine_flags = {name: getattr(resolved, name) for name in (
        "device", "dtype", "kv_cache_dtype", "quantization", "block_size", "max_num_seqs", "max_num_batched_tokens",
        "enable_prefix_caching", "tensor_parallel_size", "enforce_eager", "attention_backend", "num_threads",
        "load_format", "seed")}
    engine_flags["max_num_seqs"] = given_max_num_seqs
    engine_flags["max_model_len"] = engine.max_model_len
    engine_flags["async_scheduling"] = engine.async_scheduling
    profile = Profile(
        model=ModelIdentity(name=config.model, identity=engine.hash_namespace.model),
        engine=engine_flags, machine=_machine(engine), versions=_versions(),
        prefill_points=tuple(prefill_points), prefill=prefill_fit,
        decode_points=tuple(decode_points), decode=decode_fit,
        handoff=handoff, handoff_skipped=skipped, one_thread=one_thread, tensor_parallel=tensor_parallel,
        contention={phase: tuple(ContentionPoint(background_cores=cores, slowdown=slowdown)
                                 for cores, slowdown in points) for phase, points in contention.items() if points},
        kv=KVCapacity(num_blocks=engine.num_kv_blocks, block_size=block_size,
                      block_bytes=engine.kv_blocks.layout.block_bytes),
        quick=quick, created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        wall_s=round(time.perf_counter() - started, 1))
    engine.close()
    return profile
