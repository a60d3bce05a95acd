"""The worker's malloc settings apply (glibc) and stick: a freed multi-MiB buffer is reused, not unmapped."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Run in a fresh interpreter: mallopt changes the whole process, and the test runner's must stay as it was.
_PROBE = """
import resource, sys
from worker.malloc_tuning import tune_malloc
assert tune_malloc() and tune_malloc()  # applied, then idempotent
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    buf = bytearray(48 << 20)  # touched on creation; above glibc's 32 MiB cap, it is mmapped and unmapped each time
    del buf
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_big_buffers_are_reused_instead_of_faulted_in_afresh() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    # Untuned, each of the 20 buffers faults its 12,288 pages in again (~245,000 faults); tuned, only the first.
    assert int(out.stdout) < 50_000, out.stdout
