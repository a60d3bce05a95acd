"""Decode's GEMMs at a few rows on a GPU: bfloat16 cuBLAS against the quantized kernels, on the Llama-3.2-1B shapes.

For each linear layer of the shape (fused qkv, o, fused gate_up, down) at each row count, in one run:

    bf16 cuBLAS       F.linear on the bfloat16 weight (the unquantized engine)
    int8 tl.dot       triton/int8_linear.py (the int8 path above MAX_ROWS rows)
    fp8 scaled_mm     fp8_linear: the Triton activation quantizer + torch._scaled_mm (the fp8 path above MAX_ROWS)
    int8 / fp8 gemv   triton/weight_only_gemv.py at each tile of --tiles (BLOCK_N x BLOCK_K / warps)

Each call reads its weight from HBM, as a decode step does: every configuration cycles through enough copies of
its weight (≥ 512 MiB in all) that none is left in L2 from the call before. Time per call: 100 calls captured in a
CUDA graph (as the decode step runs them), CUDA events around a replay, best of 3; GB/s: the weight's bytes over
that; the step: 16 layers' four GEMMs summed.

    PYTHONPATH=. python bench/quantized_gemv.py [--rows 1,4] [--tiles 8x512/4,16x256/4,4x1024/4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.kernels.fp8_linear import fp8_linear  # noqa: E402
from engine.kernels.quantized_weight import QuantizedWeight  # noqa: E402
from engine.kernels.triton import weight_only_gemv as gemv  # noqa: E402
from engine.kernels.triton.int8_linear import int8_linear  # noqa: E402
from engine.loader.dummy_weights import dummy_model_config  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402

SHAPE = "llama-3.2-1b"  # the dummy shape whose layers are timed (engine/loader/dummy_weights.py)


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of one layer's four GEMMs, as the engine fuses them (q/k/v, gate/up)."""
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    attention = config.num_heads * config.head_dim
    return {"qkv": (qkv, config.hidden_size), "o": (config.hidden_size, attention),
            "gate_up": (2 * config.intermediate_size, config.hidden_size),
            "down": (config.hidden_size, config.intermediate_size)}
COPIES_BYTES = 512 << 20


def time_call(fn: Callable[[int], object], copies: int, calls: int = 100, rounds: int = 3) -> float:
    """GPU seconds per call of fn(i % copies), best of `rounds`: `calls` calls captured in one CUDA graph and
    replayed, as a decode step's graph runs them (timed eagerly, a Triton launch's ~20 µs of host work would be
    the figure, not the kernel)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune, allocate: outside the capture
        for i in range(min(copies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    del graph
    return best


def parse_tiles(text: str) -> list[tuple[int, int, int]]:
    tiles = []
    for item in text.split(","):
        shape, warps = item.split("/")
        n, k = shape.split("x")
        tiles.append((int(n), int(k), int(warps)))
    return tiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4")
    p.add_argument("--tiles", default="8x512/4,16x256/4,4x1024/4,16x512/8,32x256/8,4x512/2,8x1024/8,2x1024/2")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    torch.manual_seed(0)
    tiles = parse_tiles(args.tiles)
    results: dict[str, dict[str, float]] = {}  # config -> "layer@rows" -> seconds
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    config = dummy_model_config(SHAPE)
    shapes = layer_shapes(config)
    for layer, (n, k) in shapes.items():
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        copies = max(2, COPIES_BYTES // (n * k * 2))
        bf16 = [dense.clone() for _ in range(copies)]
        int8 = [QuantizedWeight.quantize_int8(dense.float()) for _ in range(max(2, COPIES_BYTES // (n * k)))]
        fp8 = [QuantizedWeight.quantize_fp8(dense.float()) for _ in range(len(int8))]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            configs: dict[str, tuple[Callable[[int], object], int, int]] = {
                "bf16 cuBLAS": (lambda i: F.linear(x, bf16[i]), len(bf16), 2),
                "int8 tl.dot": (lambda i: int8_linear(x, int8[i]), len(int8), 1),
                "fp8 scaled_mm": (lambda i: fp8_linear(x, fp8[i]), len(fp8), 1),
            }
            for bn, bk, warps in tiles:
                for name, weights in (("int8", int8), ("fp8", fp8)):
                    configs[f"{name} gemv {bn}x{bk}/{warps}"] = (
                        lambda i, w=weights, bn=bn, bk=bk, warps=warps: gemv.weight_only_gemv(
                            x, w[i], block_n=bn, block_k=bk, num_warps=warps), len(weights), 1)
            for name, (fn, count, elem) in configs.items():
                seconds = time_call(fn, count)
                results.setdefault(name, {})[f"{layer}@{rows}"] = seconds
                print(f"{layer:8s} {n:6d}x{k:<5d} rows {rows}  {name:24s} {seconds * 1e6:8.1f} us  "
                      f"{n * k * elem / seconds / 1e9:7.0f} GB/s", flush=True)
        del bf16, int8, fp8
        torch.cuda.empty_cache()
    print(f"\nthe step's GEMMs ({config.num_layers} layers x qkv, o, gate_up, down), us:")
    rows_list = [int(r) for r in args.rows.split(",")]
    print("| config | " + " | ".join(f"rows {r}" for r in rows_list) + " | / bf16 at rows 1 |")
    print("|---|" + "---:|" * (len(rows_list) + 1))
    step = {name: {r: config.num_layers * sum(t[f"{layer}@{r}"] for layer in shapes) for r in rows_list}
            for name, t in results.items()}
    base = step["bf16 cuBLAS"][rows_list[0]]
    for name, by_rows in step.items():
        print(f"| {name} | " + " | ".join(f"{by_rows[r] * 1e6:,.0f}" for r in rows_list)
              + f" | {by_rows[rows_list[0]] / base:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "per_call_s": results,
                       "step_s": {n: {str(r): s for r, s in v.items()} for n, v in step.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
