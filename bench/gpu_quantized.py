"""bench/gpu.py --quantization METHOD: the decode step of each shape with METHOD's weights against the same shape
unquantized (bf16 on a GPU, float32 on cpu), both measured in the one run, one engine after the other.

    PYTHONPATH=. python3 bench/gpu.py --quantization fp8 --shapes llama-3.2-1b --batches 1,256 --json q.json

Per batch (`--batches`; issue 34's targets are at 1 and 256): the median step time and tokens/s of each engine
(bench/gpu.py's measure_decode: the same prompts, context and steps) and the ratios

    step ratio     METHOD's step ms / none's       (issue 34, fp8 at batch 1: <= 0.6)
    tok/s ratio    METHOD's tokens/s / none's      (issue 34, fp8 at batch 256: >= 1.3)

and the weight bytes a step reads with each (`model_weight_bytes`: the model's linear layers, head and norms as it
holds them), which the rows' floors use. The weights: the shape's dummy weights (seeded, the same for both);
int8 and fp8 quantize them at load as the engine does for any checkpoint; gguf has no file here, so the dummy
weights' linear layers are quantized to Q4_1 blocks with gguf's own quantizer (`gguf_dummy_weights`: on the
host, ~5 s for Llama-3.2-1B) and the engine loads those blocks as it would a GGUF file's (the head: Q8_0, by
the model).

Prefill and HF `generate` are not run in this mode; CUDA graphs as bench/gpu.py sets them for both engines.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from engine.kernels.quantized_weight import QuantizedWeight
from engine.model.quantization import is_linear_weight

QUANTIZATIONS = ("none", "int8", "gguf", "fp8")
# issue 34's targets (fp8 on a GPU): (batch, key, comparison, bound)
TARGETS = {"fp8": ((1, "step_ratio", "<=", 0.6), (256, "tokens_per_s_ratio", ">=", 1.3))}


def gguf_dummy_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | QuantizedWeight]:
    """`weights` with every linear layer's matrix in Q4_1 blocks (gguf's quantizer, on the host; each moved back
    to its tensor's device), as a GGUF file of these weights would hold them. A new dict."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    q4_1 = GGMLQuantizationType.Q4_1
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, weight in weights.items():
        if is_linear_weight(name):
            blocks = quantize(weight.detach().float().cpu().numpy(), q4_1)
            out[name] = QuantizedWeight.from_gguf(blocks, q4_1, tuple(weight.shape)).to(weight.device)
        else:
            out[name] = weight
    return out


def model_weight_bytes(model: Any) -> int:
    """Bytes a decode step reads of the model's weights as it holds them: every layer's linear layers (quantized
    bytes and scales, or the float matrix) and norms, the LM head, the final norm. The embedding only gathers rows
    (a tied one is read as the head)."""

    def linear(lin: Any) -> int:
        if lin.quantized is not None:
            return lin.quantized.nbytes
        weight = lin.dense_weight()
        bias = 0 if lin.bias is None else lin.bias.numel() * lin.bias.element_size()
        return weight.numel() * weight.element_size() + bias

    def tensor(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    total = linear(model.lm_head) + tensor(model.final_norm)
    for layer in model.layers:
        total += sum(linear(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        total += tensor(layer.input_norm) + tensor(layer.post_norm)
    return total


def check_method(method: str, device: torch.device) -> str | None:
    """Why `method` cannot run on `device` (the engine's own check), or None."""
    from engine.model.quantization import check_quantization

    try:
        check_quantization(method, device)
    except ValueError as exc:
        return str(exc)
    return None


def ratios(none_rows: list[dict], method_rows: list[dict], method: str) -> list[dict]:
    """Per batch measured with both: METHOD's step time and tokens/s over none's, and issue 34's target where
    there is one (`met` None: no target at this batch)."""
    out = []
    for q in method_rows:
        base = next((r for r in none_rows if r["batch"] == q["batch"]), None)
        if base is None:
            continue
        row = {"batch": q["batch"], "none_step_ms": base["step_ms"], "step_ms": q["step_ms"],
               "step_ratio": q["step_ms"] / base["step_ms"], "none_tokens_per_s": base["tokens_per_s"],
               "tokens_per_s": q["tokens_per_s"], "tokens_per_s_ratio": q["tokens_per_s"] / base["tokens_per_s"],
               "target": None, "met": None}
        for batch, key, op, bound in TARGETS.get(method, ()):
            if batch == q["batch"]:
                row["target"] = f"{key} {op} {bound}"
                row["met"] = row[key] <= bound if op == "<=" else row[key] >= bound
        out.append(row)
    return out


def bench_quantized(shape: str, build: Callable[[str], Any], measure: Callable[[Any, int, Callable], dict],
                    kv_token_bytes: int, bandwidth: float, args: argparse.Namespace, result: dict[str, Any],
                    save: Callable[[], None], phase: Callable[..., Any], free: Callable[[], None]) -> None:
    """Decode at each of args.batches with `none`, then with args.quantization, each engine freed before the next;
    fills result["quantized"] (rows per method, the ratios) and calls `save()` after each row.

    `build(method)` makes the engine, `measure(engine, batch, floor)` is bench/gpu.py's measure_decode, `phase`
    its error-recording runner (a failed phase is recorded and the rest goes on)."""
    method = args.quantization
    out: dict[str, Any] = {"method": method, "rows": {}, "weight_bytes": {}}
    result["quantized"] = out
    for name in ("none", method):
        engine = phase(result, f"engine_{name}", lambda n=name: build(n))
        if engine is None:
            continue
        w_bytes = model_weight_bytes(engine.runner.model)
        out["weight_bytes"][name] = w_bytes

        def floor(kv_tokens: float, w: int = w_bytes) -> tuple[float, float]:
            read = w + kv_tokens * kv_token_bytes
            return read / bandwidth, read

        rows = out["rows"].setdefault(name, [])
        for batch in args.batches:
            row = phase(result, f"decode_{batch}_{name}", lambda b=batch, e=engine: measure(e, b, floor), engine)
            if row is None:
                continue
            rows.append(row)
            save()
            print(f"decode {shape} {name:>4} batch {batch:>4} x {args.context} ctx: {row['step_ms']:8.3f} ms/step, "
                  f"{row['tokens_per_s']:10,.0f} tok/s  ({w_bytes / 1e6:,.0f} MB of weights, floor "
                  f"{row['floor_ms']:.3f} ms)", flush=True)
        del engine
        free()
    out["ratios"] = ratios(out["rows"].get("none", []), out["rows"].get(method, []), method)
    if "none" in out["weight_bytes"] and method in out["weight_bytes"]:
        out["weight_bytes_ratio"] = out["weight_bytes"][method] / out["weight_bytes"]["none"]
    for r in out["ratios"]:
        target = "" if r["target"] is None else f"  target {r['target']}: {'met' if r['met'] else 'NOT met'}"
        print(f"{shape} {method} / none, batch {r['batch']:>4}: step x{r['step_ratio']:.3f}, "
              f"tok/s x{r['tokens_per_s_ratio']:.3f}{target}", flush=True)
    save()
