"""Tensor parallelism on CPU: TP 1 with 2 threads against TP 2 with 1 thread a rank, the same cores, same run.

    .venv/bin/python bench/tensor_parallel.py [--model llama-3.2-1b] [--decode-tokens 16] [--prompt-tokens 2000]

Dummy weights (float32) of the named shape. For each engine: decode tok/s at batch 1 and at batch 32 (the steps
after every request's first token: engine steps end to end, scheduling and sampling included), and the TTFT of one
2,000-token prompt (its one prefill step). Prints TP 2's figures against TP 1's and, for TP 2, the time rank 0 spent
in all-reduces per layer and step (two a layer: after attention's o_proj and the MLP's down_proj; rank 0's wait
includes the other rank's lag to the collective). TP 2's collectives go through shared memory
(engine/distributed/shm_collectives.py); `--tp2-gloo` also runs TP 2 over gloo's sockets, what it used before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.distributed import shm_collectives  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request.sampling_params import SamplingParams  # noqa: E402


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, 30000, (length,), generator=g).tolist()


def decode_rate(engine: LLMEngine, batch: int, decode_tokens: int, tag: str) -> tuple[float, float, int]:
    """(tok/s over the decode steps, all-reduce seconds in them, decode steps) for `batch` 32-token prompts."""
    for i in range(batch):
        engine.add_request(f"{tag}{i}", prompt(32, i), greedy(decode_tokens + 1))
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # the prefills, up to every request's first token
    timer = _timer(engine)
    if timer is not None:
        timer.reset()
    num_tokens = num_steps = 0
    start_s = time.perf_counter()
    while engine.has_unfinished_requests():
        num_tokens += _step_tokens(engine)
        num_steps += 1
    seconds = time.perf_counter() - start_s
    assert engine.block_pool.num_used_blocks == 0
    return num_tokens / seconds, timer.all_reduce_s if timer is not None else 0.0, num_steps


def _step_tokens(engine: LLMEngine) -> int:
    before = engine.outputs.num_generation_tokens
    engine.step()
    return engine.outputs.num_generation_tokens - before


def ttft(engine: LLMEngine, length: int, tag: str) -> float:
    engine.add_request(tag, prompt(length, 99), greedy(1))
    start_s = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start_s


def _timer(engine: LLMEngine):  # noqa: ANN202 - the TP group's CollectiveTimer, None at TP 1
    group = getattr(engine.runner.model, "group", None)
    return group.timer if group is not None and group.size > 1 else None


def measure(args: argparse.Namespace, tp: int, threads: int, collectives: str = "shm") -> dict[str, float]:
    start_s = time.perf_counter()
    os.environ[shm_collectives.ENV] = collectives  # read as the engine starts its ranks
    engine = LLMEngine(EngineConfig(
        model=args.model, load_format="dummy", dtype="float32", tensor_parallel_size=tp, num_threads=threads,
        max_model_len=args.prompt_tokens + 64, max_num_seqs=32, max_num_batched_tokens=max(2048, args.prompt_tokens),
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False, seed=0))
    os.environ.pop(shm_collectives.ENV)
    print(f"TP {tp} x {threads} thread(s), collectives {collectives}: started in {time.perf_counter() - start_s:.1f} s",
          flush=True)
    layers = engine.model_config.num_layers
    try:
        decode_rate(engine, 2, 4, "warm")  # first-call costs (oneDNN primitives, allocations) out of the figures
        out: dict[str, float] = {}
        for batch in (1, 32):
            rates, reduces = [], []
            for rep in range(args.reps):
                rate, reduce_s, steps = decode_rate(engine, batch, args.decode_tokens, f"b{batch}r{rep}-")
                rates.append(rate)
                reduces.append(reduce_s / steps / layers)
            out[f"decode_b{batch}"] = statistics.median(rates)
            out[f"reduce_b{batch}"] = statistics.median(reduces)
            out[f"step_b{batch}"] = batch / out[f"decode_b{batch}"] / layers  # seconds per layer per step
        out["ttft"] = min(ttft(engine, args.prompt_tokens, f"ttft{rep}") for rep in range(args.ttft_reps))
        return out
    finally:
        engine.close()
        del engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--num-kv-blocks", type=int, default=320)
    p.add_argument("--reps", type=int, default=2, help="decode runs at each batch size (the median is reported)")
    p.add_argument("--ttft-reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="cores: TP 1 gets them all, TP 2 one a rank")
    p.add_argument("--tp1-one-thread", action="store_true",
                   help="also TP 1 on one thread: what OpenMP's second thread is worth on this machine now")
    p.add_argument("--tp2-gloo", action="store_true", help="also TP 2 with its collectives over gloo's sockets")
    args = p.parse_args()
    tp1 = measure(args, 1, args.threads)
    tp2 = measure(args, 2, max(1, args.threads // 2))
    gloo = measure(args, 2, max(1, args.threads // 2), "gloo") if args.tp2_gloo else None
    one = measure(args, 1, 1) if args.tp1_one_thread else None
    print(f"\n{args.model}, dummy float32 weights, {args.threads} cores; decode: medians of {args.reps} runs of "
          f"{args.decode_tokens} tokens; TTFT: best of {args.ttft_reps}")
    print(f"{'':26s} {'TP 1':>10s} {'TP 2':>10s} {'TP2/TP1':>8s}")
    for key, label, unit in (("decode_b1", "decode tok/s, batch 1", 1), ("decode_b32", "decode tok/s, batch 32", 1),
                             ("ttft", f"TTFT {args.prompt_tokens:,} tokens (s)", 1)):
        ratio = tp2[key] / tp1[key] if key != "ttft" else tp1[key] / tp2[key]
        print(f"{label:26s} {tp1[key] * unit:10.2f} {tp2[key] * unit:10.2f} {ratio:7.2f}x"
              + ("  (TP1/TP2: >1 is TP 2 faster)" if key == "ttft" else ""))
    for batch in (1, 32):
        reduce_ms, layer_ms = tp2[f"reduce_b{batch}"] * 1e3, tp2[f"step_b{batch}"] * 1e3
        print(f"TP 2 all-reduce per layer, batch {batch:2d}: {reduce_ms:.3f} ms of {layer_ms:.3f} ms a layer-step "
              f"({reduce_ms / layer_ms:.0%})")
    print(f"target TP 2 decode at batch 32 >= 0.85x TP 1: {tp2['decode_b32'] / tp1['decode_b32']:.2f}x")
    if gloo is not None:
        print(f"TP 2 over gloo: decode {gloo['decode_b1']:.2f} / {gloo['decode_b32']:.2f} tok/s at batch 1 / 32 "
              f"({tp2['decode_b1'] / gloo['decode_b1']:.2f}x / {tp2['decode_b32'] / gloo['decode_b32']:.2f}x for "
              f"shared memory), all-reduce {gloo['reduce_b32'] * 1e3:.3f} ms a layer at batch 32, "
              f"TTFT {gloo['ttft']:.2f} s")
    if one is not None:
        print(f"TP 1 on one thread: decode {one['decode_b1']:.2f} / {one['decode_b32']:.2f} tok/s at batch 1 / 32, "
              f"TTFT {one['ttft']:.2f} s")


if __name__ == "__main__":
    main()
