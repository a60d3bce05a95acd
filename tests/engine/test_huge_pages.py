"""The KV cache asks for transparent huge pages, and gets them where the system has THP on."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import pytest
import torch

from engine.huge_pages import HUGE_PAGE_BYTES, zeros_with_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib_in(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap the tensor's memory, from /proc/self/smaps."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            overlaps = lo < end and start < hi
        elif overlaps and (m := re.match(r"AnonHugePages:\s+(\d+) kB", line)):
            total += int(m.group(1))
    return total


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, HUGE_PAGE_BYTES // 4 + 7)])
def test_it_is_torch_zeros(shape):
    t = zeros_with_huge_pages(*shape, dtype=torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any()
    t.fill_(1)  # writable, and all of it
    assert int(t.float().sum()) == t.numel()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="transparent huge pages are off on this system",
)
def test_a_large_cache_is_backed_by_huge_pages():
    big = zeros_with_huge_pages(16 << 20, dtype=torch.float32)  # 64 MiB
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0
    assert huge_kib_in(big) >= 32 << 10  # at least half of it in 2 MiB pages (the rest: fragmentation)


def test_the_memory_goes_back_with_the_tensor():
    t = zeros_with_huge_pages(16 << 20, dtype=torch.float32)
    address = t.data_ptr()
    view = t[1:]
    del t
    gc.collect()
    assert view.sum() == 0  # a view keeps the mapping alive
    del view
    gc.collect()
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
              if int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)]
    assert mapped == []
