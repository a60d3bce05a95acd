"""Building our C++ CPU code (the engine's kernels, the KV transport's fused copy): one place for the kill switch,
the compiler flags and the fallback. It lives in kv_transfer, the lowest layer that uses torch, so that both can
reach it."""

from __future__ import annotations

import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)


def cpu_kernels_disabled() -> bool:
    """SPLITSERVE_DISABLE_CPU_KERNELS: plain torch ops for everything (our C++ kernels, the KV transports' fused copy
    and the oneDNN GEMMs)."""
    return bool(os.environ.get("SPLITSERVE_DISABLE_CPU_KERNELS"))


def build_cpu_extension(name: str, source: str, functions: list[str], cflags: list[str]) -> ModuleType | None:
    """Compile (once per machine; torch caches the build) and load `source`; None when
    SPLITSERVE_DISABLE_CPU_KERNELS is set or it cannot be built (callers then run plain torch)."""
    if cpu_kernels_disabled():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name=name,
            cpp_sources=[source],
            functions=functions,
            # -fopenmp: at::parallel_for is header code that only runs in parallel when compiled with OpenMP.
            extra_cflags=["-O3", "-march=native", *cflags, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a sandbox without /tmp
        logger.warning("C++ CPU kernels %s unavailable (%s); using torch ops", name, exc)
        return None
