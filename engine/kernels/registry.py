"""Every C++ CPU module a worker runs, loaded before it serves and built ahead by `splitserve build-kernels`.

    load_all()           each module's loader, in parallel (a missing build compiles at once, not one by one);
                         logs one line naming each module and the variant that loaded, or why its torch ops run
    native_modules()     the modules, for building ahead (kv_transfer/native_build.py does the work)
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from kv_transfer import native_build
from kv_transfer.native_build import KernelStatus, NativeModule

logger = logging.getLogger(__name__)

_logged = threading.Event()


def native_modules() -> tuple[NativeModule, ...]:
    from engine.kernels import cpu_elementwise, cpu_paged_attention, cpu_quantized_linear
    from kv_transfer import block_copy

    return (cpu_elementwise.NATIVE, cpu_paged_attention.NATIVE, cpu_quantized_linear.NATIVE, block_copy.NATIVE)


def load_all() -> list[KernelStatus]:
    """Load (building first where the cache lacks it) every module through its own cached loader, so that the
    first forward pass and the first KV handoff find them ready. Cheap after the first call in a process."""
    from engine.kernels import cpu_elementwise, cpu_paged_attention, cpu_quantized_linear
    from kv_transfer import block_copy

    loaders = (cpu_elementwise.load_elementwise, cpu_paged_attention.load_kernel, cpu_quantized_linear.load_kernel,
               block_copy.native_ops)
    with ThreadPoolExecutor(max_workers=len(loaders), thread_name_prefix="kernel-load") as pool:
        list(pool.map(lambda load: load(), loaders))
    names = {module.name for module in native_modules()}
    loaded = [status for status in native_build.statuses() if status.kernel in names]
    if not _logged.is_set():
        _logged.set()
        logger.info("C++ CPU kernels: %s", ", ".join(_describe(s) for s in loaded))
    return loaded


def _describe(status: KernelStatus) -> str:
    if status.variant == native_build.FALLBACK:
        return f"{status.kernel}=torch ops ({status.reason})"
    return f"{status.kernel}={status.variant}"
