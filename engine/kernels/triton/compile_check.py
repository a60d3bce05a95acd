"""Compile every Triton kernel here for a GPU architecture on any machine, no GPU or driver needed.

    TRITON_INTERPRET=0 python -m engine.kernels.triton.compile_check [--arch 90] [--dtypes bf16,fp32,fp16]

The interpreter tests run the kernels' arithmetic on CPUs, but the interpreter accepts what the compiler refuses
(tl.dot shapes, types across branches, scalar/block mixes). This runs the real pipeline (Triton IR, LLVM, PTX,
ptxas from the triton wheel) for each kernel at the block sizes its wrapper launches, and prints the shared memory
each needs. It knows the kernels' argument lists: a kernel that gains an argument fails here until it is listed.
Exit status 1 when any variant fails to compile.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

POINTER = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


@dataclass(frozen=True)
class Variant:
    label: str
    kernel: Any  # a triton JITFunction
    signature: dict[str, str]  # argument -> Triton type ("*bf16", "i32", "fp32"); constexprs are added
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3  # Triton's default


def _ints(*names: str) -> dict[str, str]:
    return {name: "i32" for name in names}


def variants(dtypes: list[str]) -> Iterator[Variant]:
    from engine.kernels.triton import paged_decode_attention as decode
    from engine.kernels.triton import paged_prefill_attention as prefill
    from engine.kernels.triton import (fp8_quantize, gguf_linear, int8_linear, rms_norm, rotary, rotary_store_kv,
                                       silu_and_mul, store_kv, weight_only_gemv)

    for dtype in dtypes:
        p = POINTER[dtype]
        launches = [(decode.BLOCK_N, 1)] + ([(decode.WIDE_BLOCK_N, 2)] if dtype != "fp32" else [])
        for (block_n, stages), split, head_dim in itertools.product(launches, (False, True), (64, 128)):
            scratch = "*fp32" if split else p
            yield Variant(
                f"decode {dtype} block_n={block_n} split={split} head_dim={head_dim}",
                decode._decode_kernel,
                {
                    "q_ptr": p, "cache_ptr": p, "tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": p,
                    "part_acc_ptr": scratch, "part_max_ptr": scratch, "part_sum_ptr": scratch,
                    "scale_log2": "fp32",
                    **_ints("stride_qs", "stride_qh", "stride_c_kv", "stride_c_block", "stride_c_tok",
                            "stride_c_head", "stride_bt", "stride_os", "stride_oh", "num_heads", "group",
                            "head_dim", "block_size", "partition_size", "num_splits"),
                },
                {"BLOCK_H": 16, "BLOCK_N": block_n, "BLOCK_D": head_dim, "SPLIT": split,
                 "IEEE": dtype == "fp32"},
                num_warps=decode.num_warps(head_dim, dtype == "fp32"),
                num_stages=stages,
            )
        yield Variant(
            f"decode reduce {dtype}",
            decode._reduce_kernel,
            {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "seq_lens_ptr": "*i64",
             "out_ptr": p,
             **_ints("stride_os", "stride_oh", "num_heads", "head_dim", "partition_size", "num_splits")},
            {"BLOCK_S": 16, "BLOCK_D": 64},
        )
        block = 32 if dtype == "fp32" else 64  # as paged_prefill_attention picks
        for head_dim in (64, 128):
            yield Variant(
                f"prefill {dtype} head_dim={head_dim}",
                prefill._prefill_kernel,
                {
                    "q_ptr": p, "cache_ptr": p, "tables_ptr": "*i32", "cu_q_ptr": "*i32", "context_lens_ptr": "*i32",
                    "out_ptr": p, "scale_log2": "fp32",
                    **_ints("stride_qt", "stride_qh", "stride_c_kv", "stride_c_block", "stride_c_tok",
                            "stride_c_head", "stride_bt", "stride_ot", "stride_oh", "group", "head_dim",
                            "block_size"),
                },
                {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": head_dim, "IEEE": dtype == "fp32"},
                num_warps=prefill.NUM_WARPS,
            )
        yield Variant(
            f"store_kv {dtype}",
            store_kv._store_kv_kernel,
            {"k_ptr": p, "v_ptr": p, "cache_ptr": p, "slot_ptr": "*i64",
             **_ints("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_c_kv", "stride_c_block",
                     "stride_c_tok", "stride_c_head", "block_size", "num_kv_heads", "head_dim")},
            {"BLOCK_H": 8, "BLOCK_D": 64},
        )
        for residual, gather in ((False, False), (True, False), (False, True)):
            yield Variant(
                f"rms_norm {dtype} residual={residual} gather={gather}",
                rms_norm._rms_norm_kernel,
                {"x_ptr": p, "ids_ptr": "*i64" if gather else p, "residual_ptr": p, "weight_ptr": p, "out_ptr": p,
                 "residual_out_ptr": p, **_ints("stride_x", "stride_r", "stride_o", "stride_ro", "hidden"),
                 "eps": "fp32"},
                {"BLOCK": 4096, "HAS_RESIDUAL": residual, "GATHER": gather},
                num_warps=16,
            )
        yield Variant(
            f"rotary {dtype}",
            rotary._rotary_kernel,
            {"q_ptr": p, "k_ptr": p, "positions_ptr": "*i64", "cos_ptr": p, "sin_ptr": p,
             **_ints("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_cos", "stride_sin", "num_heads",
                     "num_kv_heads", "half")},
            {"BLOCK_H": 32, "BLOCK_KV": 8, "BLOCK_HALF": 32},
        )
        for heads, kv_heads in ((16, 4), (32, 8)):  # SmolLM2-135M's 9:3 and Llama-3.2-1B's 32:8, as launched
            yield Variant(
                f"rotary_store_kv {dtype} heads={heads}:{kv_heads}",
                rotary_store_kv._rotary_store_kv_kernel,
                {"q_ptr": p, "k_ptr": p, "v_ptr": p, "cache_ptr": p, "slot_ptr": "*i64", "positions_ptr": "*i64",
                 "cos_ptr": p, "sin_ptr": p,
                 **_ints("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                         "stride_c_kv", "stride_c_block", "stride_c_tok", "stride_c_head", "stride_cos",
                         "stride_sin", "num_heads", "num_kv_heads", "half", "block_size")},
                {"BLOCK_H": heads, "BLOCK_KV": kv_heads, "BLOCK_HALF": 32},
            )
        yield Variant(
            f"silu_and_mul {dtype}",
            silu_and_mul._silu_and_mul_kernel,
            {"x_ptr": p, "out_ptr": p, **_ints("stride_x", "stride_o", "inter")},
            {"BLOCK": silu_and_mul.BLOCK},
        )
        for in_features in (2048, 8192):  # Llama-3.2-1B's hidden and intermediate sizes
            block, warps = fp8_quantize.launch_shape(in_features)
            yield Variant(
                f"fp8_quantize {dtype} in={in_features}",
                fp8_quantize._fp8_quantize_kernel,
                {"x_ptr": p, "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", **_ints("K", "stride_x")},
                {"BLOCK": block},
                num_warps=warps,
            )
        for tokens in (1, 32, 256):  # each launch shape the wrappers pick
            block_m, block_n, warps = gguf_linear.launch_shape(tokens, fp32=dtype == "fp32")
            for fmt in (gguf_linear.FMT_Q4_0, gguf_linear.FMT_Q4_1, gguf_linear.FMT_Q8_0):
                yield Variant(
                    f"gguf_linear {dtype} fmt={fmt} tokens={tokens}",
                    gguf_linear._gguf_linear_kernel,
                    {"x_ptr": p, "w_ptr": "*u8", "w16_ptr": "*fp16", "y_ptr": p,
                     **_ints("M", "N", "num_blocks", "stride_xm", "stride_ym", "row_bytes")},
                    {"FMT": fmt, "BLOCK_BYTES": (18, 20, 34)[fmt], "BLOCK_M": block_m, "BLOCK_N": block_n,
                     "UNROLL": gguf_linear.UNROLL, "IEEE": dtype == "fp32"},
                    num_warps=warps,
                )
            block_m, block_n, block_k, warps = int8_linear.launch_shape(tokens)
            yield Variant(
                f"int8_linear {dtype} tokens={tokens}",
                int8_linear._int8_linear_kernel,
                {"x_ptr": p, "w_ptr": "*i8", "scale_ptr": "*fp32", "y_ptr": p,
                 **_ints("M", "N", "K", "stride_xm", "stride_ym")},
                {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "IEEE": dtype == "fp32"},
                num_warps=warps,
            )
        for weight_type in ("*i8", "*fp8e4nv"):
            yield Variant(
                f"weight_only_gemv {dtype} {weight_type[1:]}",
                weight_only_gemv._weight_only_gemv_kernel,
                {"x_ptr": p, "w_ptr": weight_type, "scale_ptr": "*fp32", "y_ptr": p,
                 **_ints("N", "K", "stride_xm", "stride_ym")},
                {"BLOCK_N": weight_only_gemv.BLOCK_N, "BLOCK_K": weight_only_gemv.BLOCK_K},
                num_warps=weight_only_gemv.NUM_WARPS,
            )


def compile_variant(variant: Variant, arch: int) -> int:
    """-> the shared memory (bytes) the compiled kernel needs; raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**variant.signature, **{name: "constexpr" for name in variant.constexprs}}
    compiled = triton.compile(
        ASTSource(variant.kernel, signature, variant.constexprs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
    )
    return int(compiled.metadata.shared)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--dtypes", default="bf16,fp32,fp16")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        out("TRITON_INTERPRET=1 turns @triton.jit into the interpreter, which compiles nothing: run with it unset")
        return 2
    failures = 0
    for variant in variants(args.dtypes.split(",")):
        start = time.perf_counter()
        try:
            shared = compile_variant(variant, args.arch)
        except Exception as exc:  # report every variant, then fail
            failures += 1
            out(f"FAIL {variant.label}: {type(exc).__name__}: {exc}")
            continue
        out(f"ok   {variant.label:<40} shared memory {shared:6d} B   {time.perf_counter() - start:4.1f} s")
    out(f"sm_{args.arch}: {failures} of the variants failed to compile" if failures else f"sm_{args.arch}: all compile")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
