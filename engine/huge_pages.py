"""Transparent huge pages for the KV cache: fewer TLB misses when decode attention walks scattered blocks.

The paged KV cache is one big tensor whose blocks decode attention reads in the order the block tables say, a
few KiB here and there across gigabytes: with 4 KiB pages nearly every block costs TLB misses. Linux's THP in
`madvise` mode (the common default) gives 2 MiB pages only to ranges that ask with madvise(MADV_HUGEPAGE) before
their pages are first touched, so the cache gets a fresh anonymous mapping of its own (malloc might hand back
pages already touched) and asks for them. Best effort: where THP is off or this is not Linux, nothing changes.
bench/kv_huge_pages.py measures what it is worth.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20


def zeros_with_huge_pages(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on CPU, in 2 MiB pages where the system grants them. The memory is returned
    to the system when the tensor (and every view of it) is gone."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(*shape, dtype=dtype)
    # Private and anonymous (a shared mapping would be shmem, which THP leaves alone), untouched; the slack lets the
    # tensor start on a 2 MiB boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError as exc:  # THP compiled out: small pages it is
        logger.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
    tensor = whole[offset : offset + nbytes].view(dtype).view(shape)
    return tensor.zero_()  # touch every page now, not during the first steps
