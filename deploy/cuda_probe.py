"""The CUDA devices of this machine, counted without torch: `serve` checks --device and splits the GPU memory
share before any worker starts, and stays torch-free while doing so (its workers import torch, it does not)."""

from __future__ import annotations


def cuda_device_count() -> int:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies), asked of the driver library directly, as
    torch.cuda.is_available() does: this process stays torch-free. 0 without a driver."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
