"""Decode attention over a paged KV cache: the torch backend (gather + SDPA) vs the C++ paged kernel, same run.

    .venv/bin/python bench/decode_attention.py [--num-seqs 34] [--threads 2]

Prints ms per layer call of each, the effective KV bandwidth, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.kernels.cpu_paged_attention import paged_decode_attention  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=34)
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=900)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 4000  # SmolLM2's attention shape
    q = torch.randn(args.num_seqs, heads, head_dim, generator=g)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    lens = torch.sort(torch.randint(args.min_len, args.max_len, (args.num_seqs,), generator=g)).values
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(args.num_seqs)])
    meta = AttentionMetadata(
        num_tokens=args.num_seqs, slot_mapping=torch.zeros(args.num_seqs, dtype=torch.int64),
        num_decode_tokens=args.num_seqs, decode_block_tables=tables, decode_seq_lens=lens, prefills=(),
    )
    backend = TorchAttentionBackend(scale=head_dim**-0.5)
    torch_s = timed(lambda: backend.decode(q, kv, meta), args.reps)
    kernel_s = timed(lambda: paged_decode_attention(q, kv[0], kv[1], tables, lens, head_dim**-0.5), args.reps)
    kv_bytes = int(lens.sum()) * kv_heads * head_dim * 4 * 2
    print(f"{args.num_seqs} seqs, contexts {args.min_len}-{args.max_len}, {args.threads} threads")
    for name, secs in (("torch gather + SDPA", torch_s), ("C++ paged kernel", kernel_s)):
        print(f"  {name:20s} {secs * 1e3:7.2f} ms/layer  {kv_bytes / secs / 1e9:5.1f} GB/s")
    print(f"ratio kernel / torch: {torch_s / kernel_s:.2f}x")


if __name__ == "__main__":
    main()
