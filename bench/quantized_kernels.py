"""The quantized CPU kernels (engine/kernels/cpu_quantized_linear.py) against float32 GEMMs, on SmolLM2-135M's
linear-layer shapes, in one run.

For each shape (the engine's fused qkv and gate_up, o, down, and the tied LM head) at 1 row (single-stream
decode: a GEMV) and 32 rows (32 streams), every configuration is timed in turn, round after round:

    f32 F.linear    torch's float32 GEMM (MKL)
    f32 oneDNN      the engine's float32 path today (engine/model/linear.py: oneDNN, weight packed once)
    int8            int8 weight-only, float32 activations
    q4_1 / q8_0     GGUF blocks as stored, Q8 activations (the SmolLM2 file's own formats: Q4_1 layers,
    q4_0            Q8_0 embedding)

Decode reads every weight once a step, from memory, not from cache: each configuration cycles through enough
copies of its weight (≥ 96 MiB in all) that every call reads its weight from DRAM, as a real decode step does.
Per shape it prints the time per call (the 20th percentile of single calls, best of the rounds: the machine is
shared), the weight bytes read per second, and the speed-up over f32 oneDNN;
then the whole step's GEMMs (30 layers x 4 + the LM head) summed per configuration, and for the GGUF file as
shipped ("gguf file": Q4_1 layers, the Q8_0 embedding as LM head).

    .venv/bin/python bench/quantized_kernels.py [--threads 2] [--rounds 3] [--min-s 0.05] [--json out.json]
    .venv/bin/python bench/quantized_kernels.py --threads 1 --timer cpu     # steady on a busy machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from engine.kernels.cpu_quantized_linear import load_kernel, quantized_linear  # noqa: E402
from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight  # noqa: E402
from engine.loader.dummy_shapes import DUMMY_SHAPES  # noqa: E402
from engine.model.linear import Linear  # noqa: E402

_COLD_BYTES = 96 << 20  # more than the L3 (32 MiB here): a cycle of copies this large is read from DRAM
_MAX_COPIES = 64
_CONFIGS = ("f32 F.linear", "f32 oneDNN", "int8", "q4_1", "q8_0", "q4_0")
_BASELINE = "f32 oneDNN"


def model_shapes() -> dict[str, tuple[int, int, int]]:
    """name -> (out_features, in_features, count per decode step), from the smollm2-135m dummy shape."""
    c = DUMMY_SHAPES["smollm2-135m"]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size, c.num_layers),
        "o": (c.hidden_size, q, c.num_layers),
        "gate_up": (2 * c.intermediate_size, c.hidden_size, c.num_layers),
        "down": (c.hidden_size, c.intermediate_size, c.num_layers),
        "lm_head": (c.vocab_size, c.hidden_size, 1),
    }


def _gguf(fmt: QuantFormat, w: np.ndarray) -> QuantizedWeight:
    assert fmt.ggml_type is not None
    return QuantizedWeight.from_gguf(gguf_quantize(w, fmt.ggml_type), fmt.ggml_type, w.shape)


def _callers(name: str, w: torch.Tensor) -> tuple[list[Callable[[torch.Tensor], torch.Tensor]], int]:
    """One caller per copy of the weight in configuration `name`, and the bytes one call reads."""
    w_np = w.numpy()
    if name == "f32 F.linear":
        make, nbytes = (lambda: w.clone()), w.numel() * 4
        return [lambda x, m=m: F.linear(x, m) for m in _copies(make, nbytes)], nbytes
    if name == "f32 oneDNN":
        nbytes = w.numel() * 4
        return list(_copies(lambda: Linear(w.clone()), nbytes)), nbytes
    weight = QuantizedWeight.quantize_int8(w) if name == "int8" else _gguf(QuantFormat[name.upper()], w_np)

    def make() -> QuantizedWeight:
        scales = None if weight.scales is None else weight.scales.clone()
        return QuantizedWeight(format=weight.format, data=weight.data.clone(), in_features=weight.in_features,
                               scales=scales)

    return [lambda x, q=q: quantized_linear(x, q) for q in _copies(make, weight.nbytes)], weight.nbytes


def _copies(make: Callable[[], object], nbytes: int) -> list:
    return [make() for _ in range(max(1, min(_MAX_COPIES, -(-_COLD_BYTES // nbytes))))]


def time_call(callers: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, min_s: float,
              clock: Callable[[], float]) -> float:
    """Seconds per call: the 20th percentile of single calls, cycling through the copies for at least `min_s` (and
    one full cycle). A low percentile, not the mean: the machine is shared, and a call another process preempts (or
    whose second thread waits for a core) measures the neighbours, not the kernel."""
    for call in callers[:2]:
        call(x)
    times: list[float] = []
    start = time.perf_counter()
    while True:
        for call in callers:
            t0 = clock()
            call(x)
            times.append(clock() - t0)
        if time.perf_counter() - start >= min_s:
            return float(np.percentile(times, 20))


def run(rounds: int, min_s: float, clock: Callable[[], float]) -> dict:
    shapes = model_shapes()
    results: dict = {"threads": torch.get_num_threads(), "shapes": {}}
    kernel = load_kernel()
    if kernel is None:
        raise SystemExit("the C++ quantized kernels are not built here (see the log); nothing to measure")
    results["dot_isa"] = kernel.dot_isa(-1)
    g = torch.Generator().manual_seed(0)
    for shape_name, (out_features, in_features, count) in shapes.items():
        w = torch.randn(out_features, in_features, generator=g) * in_features**-0.5
        callers = {}
        for name in _CONFIGS:
            callers[name] = _callers(name, w)
        for rows in (1, 32):
            x = torch.randn(rows, in_features, generator=g)
            best = {name: float("inf") for name in _CONFIGS}
            for _ in range(rounds):
                for name in _CONFIGS:
                    best[name] = min(best[name], time_call(callers[name][0], x, min_s, clock))
            entry = {name: {"us": best[name] * 1e6, "weight_bytes": callers[name][1],
                            "gb_s": callers[name][1] / best[name] / 1e9} for name in _CONFIGS}
            results["shapes"].setdefault(shape_name, {"out": out_features, "in": in_features, "count": count})[
                f"rows{rows}"] = entry
            _print_shape(shape_name, out_features, in_features, rows, entry)
        del callers
    results["step"] = {}
    for rows in (1, 32):
        total = {name: sum(s["count"] * s[f"rows{rows}"][name]["us"] for s in results["shapes"].values())
                 for name in _CONFIGS}
        # The SmolLM2 GGUF as shipped: Q4_1 layers, its Q8_0 embedding as the tied LM head.
        total["gguf file"] = sum(s["count"] * s[f"rows{rows}"]["q8_0" if name == "lm_head" else "q4_1"]["us"]
                                 for name, s in results["shapes"].items())
        results["step"][f"rows{rows}"] = total
        print(f"\none decode step's GEMMs ({rows} row{'s' if rows > 1 else ''}): "
              + ", ".join(f"{name} {us / 1e3:.2f} ms ({total[_BASELINE] / us:.2f}x)" for name, us in total.items()))
    return results


def _print_shape(shape_name: str, out_features: int, in_features: int, rows: int, entry: dict) -> None:
    print(f"\n{shape_name} {in_features}->{out_features}, {rows} row{'s' if rows > 1 else ''}")
    print(f"  {'config':13} {'us/call':>9} {'weight MB':>10} {'GB/s':>7} {'vs ' + _BASELINE:>14}")
    base = entry[_BASELINE]["us"]
    for name, e in entry.items():
        print(f"  {name:13} {e['us']:9.1f} {e['weight_bytes'] / 1e6:10.2f} {e['gb_s']:7.1f} {base / e['us']:13.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every configuration; the best counts")
    parser.add_argument("--min-s", type=float, default=0.05, help="seconds of calls per timing")
    parser.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time, blind to other processes on the machine (--threads 1 only)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.timer == "cpu" and args.threads != 1:
        parser.error("--timer cpu counts only the calling thread: use it with --threads 1")
    torch.set_num_threads(args.threads)
    results = run(args.rounds, args.min_s, time.thread_time if args.timer == "cpu" else time.perf_counter)
    results["timer"] = args.timer
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
