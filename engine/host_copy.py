"""Copies between the host and the device that never stall the host on the device's queue (async scheduling).

A plain `tensor.to("cuda")` from pageable memory, or `.tolist()` of a device tensor, waits for every kernel already
queued on the stream: with a step in flight, building the next step's inputs would wait for that step to end.
Instead:

    host → device   `to_device`: the host tensor is staged in pinned memory and copied asynchronously; torch's
                    caching host allocator keeps that pinned block until the copy has completed.
    device → host   `HostCopy`: non-blocking copies into pinned memory started now, an event recorded after them;
                    `wait()` later blocks only until these copies (and the work queued before them) are done.

On the CPU both are the tensors themselves: nothing runs asynchronously there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`tensor` (on the host) on `device` (None: stays on the host), without waiting for the device."""
    if device is None or device.type == "cpu":
        return tensor
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host, started at construction; `wait()` returns the host copies."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if not any(t.device.type == "cuda" for t in tensors):
            self._host = [t if t.device.type == "cpu" else t.cpu() for t in tensors]
            return
        self._host = []
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._host.append(host)
        self._event = torch.cuda.Event()
        self._event.record()

    def done(self) -> bool:
        """Whether `wait()` would return at once."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
