"""The engine's host work per decode step at a large batch, alone: the forward is stubbed out, so a step's time is
what the host spends scheduling, building inputs, sampling, reading back, updating and detokenizing.

    python bench/host_cost.py                          # CPU, batch 256 x 1,024 context, async scheduling off
    python bench/host_cost.py --device cuda --async-scheduling on
    python bench/host_cost.py --device cuda --profile-first cuda [--release-cupti]

The model is tests/engine/tiny_model.py's (a ~700-token vocabulary, so the logits cost next to nothing), its forward
replaced by zeros and its logits by a fixed random [batch, vocab] tensor on the device. Decode steps go through the
CUDA-graph path's host code (`DecodeGraphs.run`: the static buffers, the pinned input copy and its event) with the
replay itself a no-op returning those logits; `--eager` takes the eager path (`prepare_step`) instead. Requests are
greedy, ignore EOS and all have `--context` prompt tokens, so every step after the prompts is one decode of the
whole batch.

Printed (and `--json`): the median step (one `step()` call, synchronised after it on cuda), the steady step (steps
back to back between two synchronisations) and, per phase, its mean milliseconds a step: the scheduler's
`schedule`/`can_schedule_ahead`/`update_from_output`, the runner's `launch` (the graph inputs, the sampling rows
and the sampler's launch within it), the step's `result()` (the wait and the host copy's read), the engine's
postprocessing (detokenize, outputs), and the garbage collector's passes. `--profile-first` runs one
torch.profiler session over a few steps before the timings (bench/gpu.py counts kernels that way before its
decode timings), `--release-cupti` detaches CUPTI after it (bench/kernel_count.release_cupti), to measure what a
profiler left attached costs the steps after it. `--sync-debug` (cuda) has torch warn at every op of the timed
steps that waits for the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, default_capture_sizes
from engine.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from tests.engine.tiny_model import write_tiny_checkpoint

BLOCK_SIZE = 16


class _NullReplay(DecodeGraphs):
    """The graph path's host work without a graph: a replay returns the fixed logits."""

    logits: torch.Tensor

    def _replay(self, batch: int) -> torch.Tensor:
        return self.logits[:batch]


def build(args: argparse.Namespace, directory: Path) -> LLMEngine:
    write_tiny_checkpoint(directory)
    config_path = directory / "config.json"
    model_config = json.loads(config_path.read_text(encoding="utf-8"))
    model_config["max_position_embeddings"] = 1 << 16  # the tiny model's 512 is too short for the context
    config_path.write_text(json.dumps(model_config), encoding="utf-8")
    max_len = -(-(args.context + max_tokens(args)) // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    engine = LLMEngine(EngineConfig(
        model=str(directory), device=args.device, block_size=BLOCK_SIZE, max_model_len=max_len,
        num_kv_blocks=args.batch * (max_len // BLOCK_SIZE) + 8, max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, seed=0,
        async_scheduling=args.async_scheduling == "on", enforce_eager=True,
    ))
    runner, model = engine.runner, engine.runner.model
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, vocab, generator=generator).to(model.device)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: object, meta: object) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], hidden, device=input_ids.device)

    def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        return logits[:n] if n <= args.batch else torch.zeros(n, vocab, device=logits.device)

    model.forward = forward  # type: ignore[method-assign]
    model.compute_logits = compute_logits  # type: ignore[method-assign]
    if not args.eager:
        graphs = _NullReplay(model, runner.kv_caches, block_size=BLOCK_SIZE, max_seq_len=engine.max_model_len,
                             sizes=default_capture_sizes(args.batch))
        graphs.logits = logits
        runner.graphs = graphs
    return engine


def max_tokens(args: argparse.Namespace) -> int:
    return 2 * args.steps + args.profile_steps + 64


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimers:
    """Wall time per phase, summed over the calls of the wrapped methods."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: object, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started

        setattr(obj, name, timed)

    def wrap_class(self, cls: type, name: str, label: str) -> None:
        fn = getattr(cls, name)

        def timed(this: object, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(this, *args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started

        setattr(cls, name, timed)


def instrument(engine: LLMEngine) -> PhaseTimers:
    from engine.launched_step import LaunchedStep

    timers = PhaseTimers()
    scheduler, runner = engine.scheduler, engine.runner
    timers.wrap(scheduler, "can_schedule_ahead", "can_schedule_ahead")
    timers.wrap(scheduler, "schedule", "schedule")
    timers.wrap(runner, "launch", "runner.launch")
    if runner.graphs is not None:
        timers.wrap(runner.graphs, "run", "  graph inputs (DecodeGraphs.run)")
    timers.wrap(runner, "_sampling_row", "  sampling rows")
    timers.wrap(runner.sampler, "launch", "  sampler.launch")
    timers.wrap_class(LaunchedStep, "result", "result (wait + read back)")
    timers.wrap(scheduler, "update_from_output", "update_from_output")
    timers.wrap(engine, "_postprocess", "postprocess (detokenize, outputs)")
    return timers


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = build(args, Path(tmp))
    device = engine.device
    if args.profile_first != "none":
        from bench.kernel_count import release_cupti
        import bench.kernel_count as kernel_count
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.profile_first == "cuda" else [])
        engine.add_request("profiled", list(range(3, 40)),
                           SamplingParams(temperature=0.0, max_tokens=args.profile_steps, ignore_eos=True))
        with profile(activities=activities):
            while engine.has_unfinished_requests():
                engine.step()
            sync(device)
        kernel_count._cupti_started = args.profile_first == "cuda"
    released = args.release_cupti and args.profile_first == "cuda" and release_cupti()

    prompts = torch.randint(3, engine.model_config.vocab_size, (args.batch, args.context),
                            generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens(args), ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < args.batch or engine.stats().num_requests_waiting:
        started.update(o.request_id for o in engine.step())
    for _ in range(args.warmup_steps):
        engine.step()

    timers = instrument(engine)
    collections: list[tuple[str, int, float]] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        collections.append((phase, info["generation"], time.perf_counter()))

    gc.callbacks.append(on_gc)
    sync(device)
    if args.sync_debug and device.type == "cuda":  # torch warns at each op that waits for the device
        torch.cuda.set_sync_debug_mode("warn")
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(device)
    steady_s = (time.perf_counter() - t) / args.steps
    if args.sync_debug and device.type == "cuda":
        torch.cuda.set_sync_debug_mode("default")
    gc.callbacks.remove(on_gc)
    replays = None if engine.runner.graphs is None else engine.runner.graphs.num_replays
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    gc_s = [(gen, end - start) for (_, gen, start), (_, _, end) in zip(collections[::2], collections[1::2])]
    timed_steps = 2 * args.steps  # the phases and collections cover both loops
    return {
        "device": str(device), "batch": args.batch, "context": args.context, "path": "eager" if args.eager else "graph",
        "async_scheduling": engine.async_scheduling, "profile_first": args.profile_first, "cupti_released": released,
        "step_ms": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3, "steady_step_ms": steady_s * 1e3,
        "phases_ms": {label: s / timed_steps * 1e3 for label, s in timers.seconds.items()},
        "gc_ms": sum(s for _, s in gc_s) / timed_steps * 1e3, "gc_collections": len(gc_s),
        "gc_gen2_collections": sum(1 for gen, _ in gc_s if gen == 2), "graph_replays": replays,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--async-scheduling", choices=["on", "off"], default="off")
    p.add_argument("--eager", action="store_true", help="the eager path (prepare_step), not the graph path's")
    p.add_argument("--profile-first", choices=["none", "cpu", "cuda"], default="none")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--release-cupti", action="store_true")
    p.add_argument("--sync-debug", action="store_true",
                   help="cuda: torch.cuda.set_sync_debug_mode('warn') over the timed steps (the one expected wait a "
                        "step is the read of its tokens; with async scheduling, of the step before)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['device']}, batch {args.batch} x {args.context}, {result['path']} path, async "
          f"{'on' if result['async_scheduling'] else 'off'}, profiled first: {args.profile_first}"
          f"{' (CUPTI released)' if result['cupti_released'] else ''}")
    print(f"  step {result['step_ms']:.3f} ms (min {result['step_ms_min']:.3f}), steady {result['steady_step_ms']:.3f}"
          f" ms; gc {result['gc_ms']:.3f} ms a step ({result['gc_collections']} passes, "
          f"{result['gc_gen2_collections']} of generation 2)")
    for label, ms in result["phases_ms"].items():
        print(f"  {label:<36} {ms:7.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
