"""The fused copy + CRC-32C: the native path and the fallback give the `crc32c` package's checksum and the plain
copy's bytes, for strided blocks of the paged cache, odd sizes and continued checksums; a mismatch raises."""

from __future__ import annotations

import crc32c
import pytest
import torch

from kv_transfer import block_copy
from kv_transfer.base import block_bytes
from kv_transfer.block_copy import native_ops, copy_checked, copy_checked_parts, frame, gather
from kv_transfer.layout import KVChecksumError

# the fallback always; the native path where it builds (x86-64 with a compiler, the kill switch unset)
PATHS = [pytest.param(False, id="fallback"),
         pytest.param(True, id="native", marks=pytest.mark.skipif(native_ops() is None, reason="no native build here"))]


def _paged_cache(num_blocks: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], as the workers' runners hold it
    return torch.randn((3, 2, num_blocks, 16, 2, 8), generator=torch.Generator().manual_seed(1)).to(dtype)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(block_bytes(t.contiguous()))


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_frame_gathers_a_strided_block_and_checksums_it(native: bool, dtype: torch.dtype) -> None:
    cache = _paged_cache(dtype=dtype)
    block = cache[:, :, 3]  # 6 runs of 512 bytes (fp32), 2 KiB apart
    assert not block.is_contiguous()
    message, crc = frame(b"HEAD", block, b"TAIL", native=native)
    data = _raw(block)
    assert crc == crc32c.crc32c(data)
    assert message == b"HEAD" + data + b"TAIL" + crc.to_bytes(4, "little")


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("num_bytes", [0, 1, 7, 8, 9, 23, 24, 25, 255, 256, 257, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 5,
                                       12345 * 8 + 3, 737_280, 737_280 + 77])
def test_frame_matches_crc32c_at_every_size_and_continues_a_checksum(native: bool, num_bytes: int) -> None:
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(num_bytes))
    raw = bytes(data.numpy())
    for start in (0, 0xDEADBEEF):
        message, crc = frame(b"", data, b"", crc32c=start, append_crc=False, native=native)
        assert message == raw and crc == crc32c.crc32c(raw, start)
    # a block in two chunks: the second continues the first's checksum, as the sender does for a split block
    half = num_bytes // 2
    _, first = frame(b"", data[:half], b"", append_crc=False, native=native)
    _, whole = frame(b"", data[half:], b"", crc32c=first, append_crc=False, native=native)
    assert whole == crc32c.crc32c(raw)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize(("shape", "dtype"), [((400, 2, 3, 5, 2), torch.float32), ((501, 2, 3, 7, 3), torch.uint8)],
                         ids=["40-byte-runs", "21-byte-runs"])
def test_frame_handles_blocks_split_across_many_runs_and_lanes(native: bool, shape: tuple, dtype: torch.dtype) -> None:
    # Many short runs that the three lanes (each a third of the block) start and end inside of, mid-word; the
    # uint8 case also leaves every run a few bytes past its last whole word, and the last lane a tail of 18 bytes.
    cache = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    block = cache[:, :, 1]
    assert block.numel() * block.element_size() > 3 * 4096  # long enough for three lanes
    message, crc = frame(b"", block, b"", append_crc=False, native=native)
    assert message == _raw(block) and crc == crc32c.crc32c(_raw(block))
    dst = torch.zeros_like(cache)
    copy_checked(dst[:, :, 2], block.contiguous(), crc, native=native)
    assert torch.equal(dst[:, :, 2], block)


@pytest.mark.parametrize("native", PATHS)
def test_copy_checked_scatters_into_the_cache_and_verifies(native: bool) -> None:
    source = _paged_cache()[:, :, 2].contiguous()  # a received block: contiguous bytes
    received = torch.frombuffer(bytearray(_raw(source)), dtype=source.dtype).view(source.shape)
    cache = torch.zeros_like(_paged_cache())
    copy_checked(cache[:, :, 4], received, crc32c.crc32c(_raw(source)), native=native)
    assert torch.equal(cache[:, :, 4], source)
    assert not cache[:, :, :4].any() and not cache[:, :, 5:].any()  # nothing outside the block was touched


@pytest.mark.parametrize("native", PATHS)
def test_copy_checked_raises_on_a_mismatch(native: bool) -> None:
    source = _paged_cache()[:, :, 0].contiguous()
    good = crc32c.crc32c(_raw(source))
    corrupted = source.clone()
    corrupted.view(-1).view(torch.uint8)[100] ^= 0x01  # one bit
    cache = torch.zeros_like(_paged_cache())
    with pytest.raises(KVChecksumError, match=f"{good:#010x}"):
        copy_checked(cache[:, :, 1], corrupted, good, native=native)


@pytest.mark.parametrize("native", PATHS)
def test_copy_checked_parts_takes_one_checksum_over_every_part_in_order(native: bool) -> None:
    """An int8 block's values and scales: two strided destinations, one CRC-32C over the sources' bytes."""
    values = torch.randint(0, 256, (3, 2, 16, 2, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    scales = torch.arange(3 * 2 * 8, dtype=torch.uint8).view(3, 2, 8)
    good = crc32c.crc32c(_raw(values) + _raw(scales))
    cache_values = torch.zeros((3, 2, 5, 16, 2, 8), dtype=torch.uint8)
    cache_scales = torch.zeros((3, 2, 5, 8), dtype=torch.uint8)
    copy_checked_parts([(cache_values[:, :, 3], values), (cache_scales[:, :, 3], scales)], good, native=native)
    assert torch.equal(cache_values[:, :, 3], values) and torch.equal(cache_scales[:, :, 3], scales)
    assert not cache_scales[:, :, :3].any() and not cache_scales[:, :, 4:].any()

    swapped = crc32c.crc32c(_raw(scales) + _raw(values))  # order matters: values, then scales
    with pytest.raises(KVChecksumError, match=f"{swapped:#010x}"):
        copy_checked_parts([(cache_values[:, :, 1], values), (cache_scales[:, :, 1], scales)], swapped, native=native)
    bad_scales = scales.clone()
    bad_scales[2, 1, 7] ^= 0x80
    with pytest.raises(KVChecksumError):
        copy_checked_parts([(cache_values[:, :, 1], values), (cache_scales[:, :, 1], bad_scales)], good, native=native)


def test_copy_checked_without_a_checksum_is_a_plain_copy() -> None:
    source = _paged_cache()[:, :, 0]
    dst = torch.zeros_like(source)
    copy_checked(dst, source, None)
    assert torch.equal(dst, source)


def test_copy_checked_falls_back_across_dtypes() -> None:
    """A destination of another dtype (not a path the transports take) still copies, checked before the write."""
    source = _paged_cache()[:, :, 0].contiguous()
    dst = torch.zeros(source.shape, dtype=torch.float64)
    copy_checked(dst, source, crc32c.crc32c(_raw(source)))
    assert torch.equal(dst, source.double())
    with pytest.raises(KVChecksumError):
        copy_checked(torch.zeros_like(dst), source, 0x12345678)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_copies_a_strided_block_out_and_checksums_it(native: bool, dtype: torch.dtype) -> None:
    cache = _paged_cache(dtype=dtype)
    block = cache[:, :, 2]
    gathered, crc = gather(block, native=native)
    assert gathered.is_contiguous() and torch.equal(gathered, block)
    assert crc == crc32c.crc32c(_raw(block))
    cache[:, :, 2].zero_()  # a copy, not a view: the cache's slot can be reused once gathered
    assert crc == crc32c.crc32c(bytes(block_bytes(gathered)))


def test_host_copy_is_a_plain_copy_and_falls_back_where_memcpy_cannot_do_it() -> None:
    src = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)
    dst = torch.empty(24, dtype=torch.float32)  # another shape, same bytes: a view's copy
    block_copy.host_copy_(dst, src.view(-1))
    assert torch.equal(dst, src.view(-1))
    strided = torch.empty(6, 4, dtype=torch.float32).t()  # not contiguous: torch's copy
    block_copy.host_copy_(strided, src)
    assert torch.equal(strided, src)
    widened = torch.empty(4, 6, dtype=torch.float64)  # another dtype: torch's copy converts
    block_copy.host_copy_(widened, src)
    assert torch.equal(widened, src.double())


def test_the_fallback_copies_of_contiguous_host_blocks_never_use_torchs_thread_pool(monkeypatch) -> None:  # noqa: ANN001
    """A block's host copies in the fallback (no native code: the GPU hosts) are memcpys, not `Tensor.copy_`, whose
    intra-op threads oversubscribe the cores when a handoff's two ends copy at once (`host_copy_`)."""
    copies: list[tuple] = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: (copies.append(self.shape), real(self, src,
                                                                                                           *a, **k))[1])
    blocks = [torch.randint(0, 255, (2, 16, 64), dtype=torch.uint8) for _ in range(3)]
    message, crcs = block_copy.frame_blocks(b"head", blocks, b"tail", native=False)
    staged = torch.empty(3, 2, 16, 64, dtype=torch.uint8)
    for slot, (block, crc) in enumerate(zip(blocks, crcs, strict=True)):
        block_copy.copy_checked(staged[slot], block, crc, native=False)
        assert torch.equal(staged[slot], block)
    assert copies == []
