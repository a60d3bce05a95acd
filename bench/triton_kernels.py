"""The Triton kernels against their torch references at full size, on a CUDA GPU.

    python bench/triton_kernels.py

Llama-3.2-1B shapes (32 query heads, 8 KV heads, head_dim 64, hidden 2048, intermediate 8192), block size 16,
bfloat16. Prints ms per call of each (triton.testing.do_bench, median), the speed-up, and for decode attention the
KV bytes read per second. About half a minute on an H100. Results go to docs/benchmarks.md, not to comments here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK_SIZE = 32, 8, 64, 2048, 8192, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5


def paged_case(context_lens: list[int], query_lens: list[int], g: torch.Generator):
    """A cache with each request's blocks scattered (a shuffled block id order), and its tables."""
    used = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(used) + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    perm = torch.randperm(num_blocks, generator=g, device="cuda")
    tables = torch.zeros(len(context_lens), max(used), dtype=torch.int32, device="cuda")
    start = 0
    for s, n in enumerate(used):
        tables[s, :n] = perm[start : start + n]
        start += n
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    return q, cache, tables


def row(name: str, kernel: Callable[[], object], reference: Callable[[], object], kv_bytes: int = 0) -> None:
    from triton.testing import do_bench

    ms = do_bench(kernel, warmup=10, rep=50)
    ref_ms = do_bench(reference, warmup=3, rep=20)
    rate = f"  {kv_bytes / ms / 1e6:7.0f} GB/s KV read" if kv_bytes else ""
    print(f"{name:<52} triton {ms:8.3f} ms   torch {ref_ms:8.3f} ms   x{ref_ms / ms:6.1f}{rate}", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/triton_kernels.py needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False).")
        return 1
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench/triton_kernels.py needs triton (pip install triton); it is not importable here.")
        return 1
    from engine.kernels.triton.paged_decode_attention import (
        paged_decode_attention,
        paged_decode_attention_reference,
    )
    from engine.kernels.triton.paged_prefill_attention import (
        paged_prefill_attention,
        paged_prefill_attention_reference,
    )
    from engine.kernels.triton.rms_norm import rms_norm, rms_norm_reference
    from engine.kernels.triton.rotary import rotary, rotary_reference
    from engine.kernels.triton.silu_and_mul import silu_and_mul, silu_and_mul_reference
    from engine.kernels.triton.store_kv import store_kv, store_kv_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {DTYPE}")
    print(f"Llama-3.2-1B attention: {HEADS} heads / {KV_HEADS} KV heads / head_dim {HEAD_DIM}, block {BLOCK_SIZE}")

    element = torch.finfo(DTYPE).bits // 8
    for num_seqs, context in [(256, 1024), (64, 4096), (4, 4096)]:
        lens = [context] * num_seqs
        q, cache, tables = paged_case(lens, [1] * num_seqs, g)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * element
        row(
            f"decode attention {num_seqs} x {context}",
            lambda: paged_decode_attention(q, cache, tables, seq_lens, SCALE, max_seq_len=context),
            lambda: paged_decode_attention_reference(q, cache, tables, seq_lens, SCALE),
            kv_bytes,
        )
        if num_seqs == 4:  # the same launch without split-K: what the split buys
            row(
                f"decode attention {num_seqs} x {context}, no split-K",
                lambda: paged_decode_attention(q, cache, tables, seq_lens, SCALE, partition_size=context),
                lambda: paged_decode_attention_reference(q, cache, tables, seq_lens, SCALE),
                kv_bytes,
            )
        del q, cache

    for name, query_lens, context_lens in [
        ("prefill 4 x 1024 fresh", [1024] * 4, [1024] * 4),
        ("extend 2 x 512 after a 3584 prefix", [512] * 2, [4096] * 2),
    ]:
        q, cache, tables = paged_case(context_lens, query_lens, g)
        cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        ctx = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
        row(
            f"prefill attention: {name}",
            lambda: paged_prefill_attention(q, cache, tables, cu, ctx, SCALE, max_query_len=max(query_lens)),
            lambda: paged_prefill_attention_reference(q, cache, tables, cu, ctx, SCALE),
        )
        del q, cache

    num_tokens = 8192
    kv = torch.randn(num_tokens, 2, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    cache = torch.zeros(2, 1024, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    slots = torch.randperm(1024 * BLOCK_SIZE, generator=g, device="cuda")[:num_tokens]
    row(
        f"store_kv {num_tokens} tokens",
        lambda: store_kv(kv[:, 0], kv[:, 1], cache, slots),
        lambda: store_kv_reference(kv[:, 0], kv[:, 1], cache, slots),
    )

    x = torch.randn(num_tokens, HIDDEN, generator=g, device="cuda").to(DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, generator=g, device="cuda").to(DTYPE)
    row(
        f"rms_norm + residual {num_tokens} x {HIDDEN}",
        lambda: rms_norm(x, weight, 1e-5, residual),
        lambda: rms_norm_reference(x, weight, 1e-5, residual),
    )

    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g, device="cuda").to(DTYPE)
    q, k = qkv[:, : HEADS * HEAD_DIM].view(num_tokens, HEADS, HEAD_DIM), qkv[:, HEADS * HEAD_DIM :][
        :, : KV_HEADS * HEAD_DIM
    ].view(num_tokens, KV_HEADS, HEAD_DIM)
    angles = torch.randn(8192, HEAD_DIM, generator=g, device="cuda")  # a real rotation: repeated calls stay finite
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    positions = torch.randint(0, 8192, (num_tokens,), generator=g, device="cuda")
    row(
        f"rotary {num_tokens} tokens (in place)",
        lambda: rotary(q, k, positions, cos, sin),
        lambda: rotary_reference(q, k, positions, cos, sin),
    )

    gate_up = torch.randn(num_tokens, 2 * INTER, generator=g, device="cuda").to(DTYPE)
    row(
        f"silu_and_mul {num_tokens} x {INTER}",
        lambda: silu_and_mul(gate_up),
        lambda: silu_and_mul_reference(gate_up),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
