"""The device digest (kv_transfer/device_digest.py) as two Triton kernels: one pass over a handoff's blocks.

    digest kernel   grid (block, slice): each program reads WORDS_PER_PROGRAM words of one block, mixes them
                    (fmix32 of the word and its position, two lanes) and writes the two lanes' sums of its slice
    combine kernel  grid (block,): adds a block's slices up modulo 2^32 and packs the lanes into one int64

Imported only when a digest runs on a GPU (so that the interpreter flag a test sets comes first); tested against
the torch path under TRITON_INTERPRET=1 (tests/kv_transfer/test_device_digest.py), bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_transfer import device_digest as ref

WORDS_PER_PROGRAM = 16384  # 64 KiB of int32 words a program: a 360 KiB block is 6 programs
BLOCK = 1024
PARTS = 16  # slices the combine kernel adds at a time

_K0 = tl.constexpr(ref.K0)
_K1 = tl.constexpr(ref.K1)
_C1 = tl.constexpr(ref.FMIX_C1)
_C2 = tl.constexpr(ref.FMIX_C2)


@triton.jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * _C1
    x = x ^ (x >> 13)
    x = x * _C2
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["num_words", "row_stride"])  # one compiled kernel for every block size
def _digest_kernel(words_ptr, partial_ptr, num_words, row_stride, WORDS: tl.constexpr, BLOCK: tl.constexpr,
                   IS_BYTES: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    row_ptr = words_ptr + row.to(tl.int64) * row_stride
    acc0 = tl.zeros([BLOCK], dtype=tl.uint32)
    acc1 = tl.zeros([BLOCK], dtype=tl.uint32)
    for offset in range(0, WORDS, BLOCK):
        idx = part * WORDS + offset + tl.arange(0, BLOCK)
        mask = idx < num_words
        raw = tl.load(row_ptr + idx, mask=mask, other=0)
        if IS_BYTES:
            w = raw.to(tl.uint32)
        else:
            w = raw.to(tl.uint32, bitcast=True)
        pos = (idx + 1).to(tl.uint32)
        x0 = _fmix32(w + pos * _K0)
        x1 = _fmix32(w ^ (pos * _K1))
        acc0 += tl.where(mask, x0, tl.zeros_like(x0))
        acc1 += tl.where(mask, x1, tl.zeros_like(x1))
    out = partial_ptr + (row * num_parts + part) * 2
    tl.store(out, tl.sum(acc0.to(tl.int64), axis=0))
    tl.store(out + 1, tl.sum(acc1.to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["num_parts"])
def _combine_kernel(partial_ptr, out_ptr, num_parts, PARTS: tl.constexpr):
    row = tl.program_id(0)
    base = partial_ptr + row.to(tl.int64) * num_parts * 2
    acc0 = tl.zeros([PARTS], dtype=tl.int64)
    acc1 = tl.zeros([PARTS], dtype=tl.int64)
    for start in range(0, num_parts, PARTS):
        parts = start + tl.arange(0, PARTS)
        mask = parts < num_parts
        acc0 += tl.load(base + parts * 2, mask=mask, other=0)
        acc1 += tl.load(base + parts * 2 + 1, mask=mask, other=0)
    lane0 = tl.sum(acc0, axis=0) & 0xFFFFFFFF
    lane1 = tl.sum(acc1, axis=0) & 0xFFFFFFFF
    high = tl.where(lane1 >= 2147483648, lane1 - 4294967296, lane1)
    tl.store(out_ptr + row, high * 4294967296 + lane0)


def digests_triton(words: torch.Tensor) -> torch.Tensor:
    """[k] int64: the digests of `words` ([k, m] int32 or uint8, rows contiguous: `digest_words`); no host sync."""
    num_blocks, num_words = words.shape
    out = torch.empty(num_blocks, dtype=torch.int64, device=words.device)
    if num_blocks == 0:
        return out
    num_parts = triton.cdiv(max(num_words, 1), WORDS_PER_PROGRAM)
    partial = torch.empty((num_blocks, num_parts, 2), dtype=torch.int64, device=words.device)
    _digest_kernel[(num_blocks, num_parts)](words, partial, num_words, words.stride(0), WORDS=WORDS_PER_PROGRAM,
                                            BLOCK=BLOCK, IS_BYTES=words.dtype == torch.uint8)
    _combine_kernel[(num_blocks,)](partial, out, num_parts, PARTS=PARTS)
    return out


def warm_up(device: torch.device) -> None:
    """Compile both kernels now (a worker's first handoff would wait a second or two for it), for every block size
    (no argument of theirs is specialised on its value)."""
    digests_triton(torch.zeros((1, 4 * WORDS_PER_PROGRAM + 5), dtype=torch.int32, device=device))
