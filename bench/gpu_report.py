"""bench/gpu.py's report: its JSON as the markdown tables docs/benchmarks.md keeps."""

from __future__ import annotations

from bench.kernel_count import kernel_row


def summary(report: dict) -> str:
    """The markdown table for docs/benchmarks.md."""
    bandwidth = report["copy_bandwidth_gb_s"]
    lines = [
        (f"Device: {report['device']}; torch {report['torch']}, triton {report['triton']}, transformers "
         f"{report['transformers']}; {report['dtype']}, dummy weights; CUDA graphs: {report['cuda_graphs']}. "
         f"Measured copy bandwidth {bandwidth:,.0f} GB/s, {report['gemm_dtype']} GEMM "
         f"{report['gemm_tflops']:,.1f} TFLOP/s."),
    ]
    if any(r.get("decode") for r in report["shapes"].values()):
        lines += [
            "",
            ("| shape | batch x context | async | step ms | steady step ms | floor ms | step / floor | GB/s read | "
             "% of copy bw | graph replay ms | replay / floor | steady / replay |"),
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for shape, r in report["shapes"].items():
        for d in r.get("decode", []):
            replay = ("- | - | -" if d.get("replay_ms") is None else
                      f"{d['replay_ms']:.3f} | {d['replay_over_floor']:.2f} | {d['steady_over_replay']:.2f}")
            lines.append(f"| {shape} | {d['batch']} x {d['context']} | {'on' if d['async_scheduling'] else 'off'} | "
                         f"{d['step_ms']:.3f} | {d['steady_step_ms']:.3f} | {d['floor_ms']:.3f} | "
                         f"{d['step_over_floor']:.2f} | {d['achieved_gb_s']:,.0f} | "
                         f"{100 * d['achieved_gb_s'] / bandwidth:.0f}% | {replay} |")
    kernel_rows = [kernel_row(shape, d) for shape, r in report["shapes"].items() for d in r.get("decode", [])
                   if isinstance(d.get("kernels"), dict) and "engine_step" in d["kernels"]]
    if kernel_rows:
        lines += ["", ("| shape | batch | kernels: graph replay | eager forward | eager, rotary unfused | engine step "
                       "(+ copies) | replay's kernel ms |"), "|---|---:|---:|---:|---:|---:|---:|", *kernel_rows]
    ratios = [(shape, row) for shape, r in report["shapes"].items() for row in r.get("async_vs_sync", [])]
    if ratios:
        lines += ["", "| shape | batch | steady step ms, async on | async off | off / on |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {shape} | {row['batch']} | {row['on_steady_step_ms']:.3f} | {row['off_steady_step_ms']:.3f} | "
                  f"{row['off_over_on']:.3f} |" for shape, row in ratios]
    quantized = [(shape, r["quantized"]) for shape, r in report["shapes"].items() if r.get("quantized")]
    for shape, q in quantized:
        lines += ["", quantized_table(shape, q)]
    if any(r.get("prefill") for r in report["shapes"].values()):
        lines += ["", ("| shape | prefill | tok/s | FLOP-floor tok/s | % of floor | generate batch | ours tok/s | "
                       "HF tok/s | ours / HF |"), "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for shape, r in report["shapes"].items():
        p, h = r.get("prefill"), r.get("hf")
        if p is None:
            continue
        gen = (f"{h['batch']} x ({h['prompt_len']}+{h['new_tokens']}) | {h['ours_tokens_per_s']:,.0f} | "
               f"{h['hf_tokens_per_s']:,.0f} | {h['ours_over_hf']:.1f}x" if h else "- | - | - | -")
        lines.append(f"| {shape} | {p['prompts']} x {p['prompt_len']} | {p['tokens_per_s']:,.0f} | "
                     f"{p['tokens_per_s_floor']:,.0f} | {p['pct_of_floor']:.1f}% | {gen} |")
    return "\n".join(lines)


def quantized_table(shape: str, q: dict) -> str:
    """--quantization's rows (bench/gpu_quantized.py): each batch's step and tokens/s against none's."""
    method, weights = q["method"], q.get("weight_bytes", {})
    sizes = ", ".join(f"{name} {weights[name] / 1e6:,.2f} MB" for name in ("none", method) if name in weights)
    lines = [f"Weights read a step ({shape}): {sizes}.", "",
             f"| shape | batch | none step ms | {method} step ms | step ratio | none tok/s | {method} tok/s | "
             "tok/s ratio | target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in q.get("ratios", []):
        target = "-" if r["target"] is None else f"{r['target']}: {'met' if r['met'] else 'not met'}"
        lines.append(f"| {shape} | {r['batch']} | {r['none_step_ms']:.3f} | {r['step_ms']:.3f} | "
                     f"{r['step_ratio']:.3f} | {r['none_tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s_ratio']:.3f} | {target} |")
    return "\n".join(lines)


def async_vs_sync(decode: list[dict]) -> list[dict]:
    """Per batch measured both ways: the steady-state step with async scheduling and without, and their ratio."""
    rows = []
    for on in (d for d in decode if d.get("async_scheduling")):
        off = next((d for d in decode if d["batch"] == on["batch"] and d.get("async_scheduling") is False), None)
        if off is not None:
            rows.append({"batch": on["batch"], "on_steady_step_ms": on["steady_step_ms"],
                         "off_steady_step_ms": off["steady_step_ms"],
                         "off_over_on": off["steady_step_ms"] / on["steady_step_ms"]})
    return rows
