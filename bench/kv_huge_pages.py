"""Decode attention over a whole model's paged KV cache: 4 KiB pages vs transparent huge pages (engine/huge_pages.py).

A 30-layer cache laid out as the engine's ([layers, 2, blocks, block_size, kv_heads, head_dim], SmolLM2's shape,
several GB: far past the caches), each sequence's blocks scattered at random; one decode step = the C++ paged
kernel on every layer. Both caches are built and timed in the same run, alternately.

    .venv/bin/python bench/kv_huge_pages.py [--num-seqs 200] [--num-blocks 16000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.huge_pages import zeros_with_huge_pages  # noqa: E402
from engine.kernels.cpu_paged_attention import paged_decode_attention  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_seconds(cache: torch.Tensor, q, tables, lens, reps: int) -> float:
    layers = cache.unbind(0)

    def step() -> None:
        for layer in layers:
            paged_decode_attention(q, layer[0], layer[1], tables, lens, HEAD_DIM**-0.5)

    step()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=200)
    p.add_argument("--num-blocks", type=int, default=16000)
    p.add_argument("--min-len", type=int, default=40)
    p.add_argument("--max-len", type=int, default=1200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    lens = torch.sort(torch.randint(args.min_len, args.max_len, (args.num_seqs,), generator=g)).values
    width = int((lens.max() + BLOCK - 1) // BLOCK)
    assert args.num_seqs * width <= args.num_blocks, "not enough blocks for distinct tables"
    tables = torch.randperm(args.num_blocks, generator=g)[: args.num_seqs * width].view(args.num_seqs, width)
    q = torch.randn(args.num_seqs, HEADS, HEAD_DIM, generator=g)
    shape = (LAYERS, 2, args.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS
    results: dict[str, list[float]] = {"4 KiB pages": [], "huge pages": []}
    for _ in range(args.rounds):
        for name, alloc in (("4 KiB pages", torch.zeros), ("huge pages", zeros_with_huge_pages)):
            cache = alloc(*shape, dtype=torch.float32)
            cache.normal_(generator=g)
            results[name].append(step_seconds(cache, q, tables, lens, args.reps))
            del cache
    print(f"{args.num_seqs} seqs, contexts {args.min_len}-{args.max_len}, cache {args.num_blocks} blocks x {LAYERS} "
          f"layers ({torch.Size(shape).numel() * 4 / 2**30:.1f} GiB)")
    for name, secs in results.items():
        best = min(secs)
        print(f"  {name:12s} {best * 1e3:7.1f} ms per step  {kv_bytes / best / 1e9:5.1f} GB/s")
    print(f"ratio huge / 4 KiB: {min(results['4 KiB pages']) / min(results['huge pages']):.2f}x")


if __name__ == "__main__":
    main()
