"""The device digest (kv_transfer/device_digest.py), what handoffs between GPUs check in place of a CRC-32C: its
torch path against a plain-Python reading of its definition, its Triton kernels against the torch path bit for bit
(in Triton's interpreter here, compiled on a GPU), and the corruptions it must catch, the ones a position-weighted
sum of words would miss included."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from kv_transfer import device_digest as dd

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # the kernels run in Triton's interpreter (set before kv_transfer.digest_kernel is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

BF16_BLOCK = (2, 2, 4, 3, 8)  # a small KV block's shape [num_layers, 2, block_size, num_kv_heads, head_dim]


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def spec_digest(data: bytes) -> int:
    """The digest as the module docstring defines it, in plain Python."""
    words = struct.unpack(f"<{len(data) // 4}I", data) if len(data) % 4 == 0 else tuple(data)
    lane0 = sum(_fmix32((w + (i + 1) * 0x9E3779B9) & 0xFFFFFFFF) for i, w in enumerate(words)) & 0xFFFFFFFF
    lane1 = sum(_fmix32(w ^ (((i + 1) * 0x85EBCA77) & 0xFFFFFFFF)) for i, w in enumerate(words)) & 0xFFFFFFFF
    value = lane1 << 32 | lane0
    return value - (1 << 64) if value >= 1 << 63 else value


def _blocks(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    if dtype == torch.int32:
        return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int32)
    return (torch.randn(shape, generator=generator) * 100).to(dtype)


@pytest.mark.parametrize(("shape", "dtype"), [((3, *BF16_BLOCK), torch.bfloat16), ((2, 7, 5), torch.float32),
                                              ((3, 13), torch.uint8), ((2, 16), torch.uint8)],
                         ids=["bf16-blocks", "fp32", "odd-bytes", "bytes-by-words"])
def test_the_torch_path_is_the_definition(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    blocks = _blocks(shape, dtype)
    expected = [spec_digest(block.contiguous().view(torch.uint8).numpy().tobytes()) for block in blocks]
    assert dd.device_digests(blocks).tolist() == expected
    assert dd.device_digests(blocks).dtype == torch.int64
    assert [int(dd.device_digest(block)) for block in blocks] == expected
    # a strided view digests as its bytes in logical order, as its contiguous copy does
    assert dd.device_digests(blocks.transpose(0, 1).contiguous().transpose(0, 1)).tolist() == expected


def test_groups_do_not_change_the_digests(monkeypatch) -> None:
    blocks = _blocks((7, *BF16_BLOCK), torch.bfloat16, seed=1)
    one_by_one = [int(dd.device_digest(block)) for block in blocks]
    monkeypatch.setattr(dd, "GROUP_BYTES", 3 * blocks[0].numel() * 2)  # groups of 3, 3, 1
    assert dd.device_digests(blocks).tolist() == one_by_one


@pytest.mark.parametrize(("shape", "dtype"), [((3, *BF16_BLOCK), torch.bfloat16), ((2, 16384 * 3 + 5), torch.int32),
                                              ((2, 37), torch.uint8), ((0, 16), torch.int32)],
                         ids=["bf16-blocks", "several-slices", "bytes", "none"])
def test_the_kernels_equal_the_torch_path(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Compiled on a GPU, in Triton's interpreter without one."""
    from kv_transfer.digest_kernel import digests_triton

    words = dd.digest_words(_blocks(shape, dtype, seed=2))
    device = "cuda" if HAS_CUDA else "cpu"
    assert digests_triton(words.to(device)).cpu().tolist() == dd.digests_torch(words).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_on_a_gpu_the_kernels_run_and_agree_with_the_cpu() -> None:
    """device_digests on cuda takes the Triton path (no silent fall back to torch) and agrees with the CPU's."""
    blocks = _blocks((63, 30, 2, 16, 3, 64), torch.bfloat16, seed=3)  # a 1,000-token SmolLM2 handoff
    dd.warm_up(torch.device("cuda"))
    on_gpu = dd.device_digests(blocks.cuda()).cpu()
    assert not dd._kernel_failed
    assert on_gpu.tolist() == dd.device_digests(blocks).tolist()


def _differs(original: torch.Tensor, changed: torch.Tensor) -> bool:
    a, b = dd.device_digest(original), dd.device_digest(changed)
    lanes = lambda d: (int(d) & 0xFFFFFFFF, (int(d) >> 32) & 0xFFFFFFFF)  # noqa: E731
    return all(x != y for x, y in zip(lanes(a), lanes(b)))  # both lanes move


def test_every_flipped_bit_changes_both_lanes() -> None:
    block = _blocks(BF16_BLOCK, torch.bfloat16, seed=4)
    raw = block.reshape(-1).view(torch.uint8)
    for position in range(raw.numel()):
        for bit in (0, 7):
            flipped = raw.clone()
            flipped[position] ^= 1 << bit
            assert _differs(raw, flipped), (position, bit)


def test_corruptions_a_weighted_sum_of_words_misses_are_caught() -> None:
    """Sum of w_i * (2i + 1) mod 2^32 misses a flipped top bit in two words (2^31 * (odd + odd) = 0 mod 2^32) and
    swapped words whose difference and distance carry enough factors of two; the mixed lanes catch both, and a
    block shifted by a word, and blocks in the wrong order."""
    words = _blocks((4, 256), torch.uint8, seed=5).view(torch.int32)  # 4 blocks of 64 words
    block = words[0]
    top_bits = block.clone()
    top_bits[[3, 40]] ^= torch.tensor(-2**31, dtype=torch.int32)
    assert _differs(block, top_bits)
    swapped = block.clone()
    swapped[[0, 32]] = block[[32, 0]]
    assert int(block[0]) != int(block[32]) and _differs(block, swapped)
    shifted = torch.roll(block, 1)
    assert _differs(block, shifted)
    assert dd.device_digests(words).tolist() != dd.device_digests(words[[1, 0, 2, 3]]).tolist()
