"""The device digest: what a handoff between GPUs checks in place of a CRC-32C, computed where the blocks lie.

A CRC-32C is a host computation; checking a block that never leaves the GPU (inproc and ipc between GPU workers)
with one would copy it out on both ends. Instead each end takes this digest of the block on the device, and the
receiver compares its own with the sender's.

    words  the block's bytes as 32-bit little-endian words w_0 .. w_{m-1} (its bytes, one per word, when its size is
           no multiple of 4: never, for the layouts a worker runs)
    lane0  Σ_i fmix32(w_i + (i + 1) * K0)  mod 2^32
    lane1  Σ_i fmix32(w_i ^ (i + 1) * K1)  mod 2^32
    digest lane1 << 32 | lane0, as a signed int64 (KVCommit.device_digests)

fmix32 is MurmurHash3's finaliser, a bijection of 32-bit words in which every input bit moves every output bit.

What it catches. Every change confined to one word changes both lanes (for a fixed position, w ↦ fmix32(w + k) is a
bijection): any corrupted byte, any run of corrupted bytes within one aligned word, a flipped bit anywhere. A
change to several words is missed only when the changes of their mixed words cancel modulo 2^32 in both lanes at
once; the mixing leaves no structure for ordinary faults (a block at the wrong offset, a stale or half-written
buffer, swapped words, flipped bits in several words) to line up with, so such a miss is as likely as a random
64-bit collision, about 2^-64 per corrupted block: no weaker than a CRC-32C's 2^-32 for errors beyond its
guaranteed ones. Unlike a CRC it is no defence against someone choosing the corruption (the keys are public), and
neither is a CRC.

The previous digest, Σ b_i (2i + 1) over bytes in int64, caught every single changed byte but widened each handoff
to int64 in two passes (8x its bytes in temporaries, 184 MB for 23 MB of KV); this one reads each word once.

On a GPU it is one Triton kernel over all of a handoff's blocks (kv_transfer/digest_kernel.py), partial sums per
slice of a block, added up by torch; elsewhere, and wherever Triton fails to load or compile, the same arithmetic in
torch ops on int64 (bit-identical: a test runs both). The digests come back as a device tensor: reading them is the
caller's one host sync.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

K0 = 0x9E3779B9  # the keys: odd, so (i + 1) * K mod 2^32 differs for every word of a block under 16 GiB
K1 = 0x85EBCA77
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
MASK32 = 0xFFFFFFFF
GROUP_BYTES = 32 << 20  # the torch path takes blocks in groups of about this many bytes (16x that in int64 temps)

_kernel_failed = False  # Triton failed once in this process: the torch path from then on


def digest_words(blocks: torch.Tensor) -> torch.Tensor:
    """[k, m]: each of `blocks`' k entries (along its first dimension) as the words the digest reads: int32 when
    its byte count is a multiple of 4, else uint8. A view when `blocks` is contiguous, else a contiguous copy."""
    data = blocks.contiguous().view(torch.uint8)
    data = data.reshape(blocks.shape[0], data.numel() // max(blocks.shape[0], 1))
    if data.shape[1] % 4 == 0 and data.numel():
        return data.view(torch.int32)
    return data


def device_digests(blocks: torch.Tensor) -> torch.Tensor:
    """[k] int64 on `blocks`' device: the digest of each of its k entries along the first dimension; no host sync."""
    global _kernel_failed
    words = digest_words(blocks)
    if words.device.type == "cuda" and not _kernel_failed:
        try:
            from kv_transfer.digest_kernel import digests_triton

            with torch.cuda.device(words.device):  # Triton launches on the current device's stream
                return digests_triton(words)
        except Exception:  # noqa: BLE001 - the torch path computes the same digests
            _kernel_failed = True
            logger.warning("the Triton device digest failed; using the torch one (same digests, slower)",
                           exc_info=True)
    return digests_torch(words)


def warm_up(device: torch.device) -> None:
    """Compile the GPU digest kernels for `device` now rather than in a worker's first handoff (nothing off a GPU)."""
    global _kernel_failed
    if device.type != "cuda" or _kernel_failed:
        return
    try:
        from kv_transfer.digest_kernel import warm_up as compile_kernels

        with torch.cuda.device(device):
            compile_kernels(device)
    except Exception:  # noqa: BLE001 - the torch path computes the same digests
        _kernel_failed = True
        logger.warning("the Triton device digest failed to compile; using the torch one (same digests, slower)",
                       exc_info=True)


def device_digest(block: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on `block`'s device: the digest of its bytes; no host sync."""
    return device_digests(block.reshape(1, -1))[0]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32): in two 16-bit halves, so that no product leaves int64."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 0x10000) & MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_C2)
    return x ^ (x >> 16)


def digests_torch(words: torch.Tensor) -> torch.Tensor:
    """The digests of `digest_words` rows in torch ops on int64 (the reference, and the path off the GPU)."""
    num_blocks, num_words = words.shape
    positions = torch.arange(1, num_words + 1, device=words.device, dtype=torch.int64)
    key0 = (positions * K0) & MASK32  # positions * K < 2^63 for any block under 8 GiB
    key1 = (positions * K1) & MASK32
    group = max(1, GROUP_BYTES // max(num_words * words.element_size(), 1))
    out = []
    for start in range(0, num_blocks, group):
        w = words[start:start + group].to(torch.int64)
        if words.dtype == torch.int32:
            w = w & MASK32  # the word's bits, unsigned
        lane0 = _fmix32((w + key0) & MASK32).sum(dim=1) & MASK32
        lane1 = _fmix32(w ^ key1).sum(dim=1) & MASK32
        out.append(combine_lanes(lane0, lane1))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device=words.device)


def combine_lanes(lane0: torch.Tensor, lane1: torch.Tensor) -> torch.Tensor:
    """lane1 << 32 | lane0 as int64 (lanes in [0, 2^32)): the top lane's high bit becomes the sign."""
    high = torch.where(lane1 >= 1 << 31, lane1 - (1 << 32), lane1)  # lane1 as a signed 32-bit value
    return high * (1 << 32) + lane0
