"""A rank's weight shard, handed from rank 0 to a child through one shared-memory buffer.

Rank 0 copies the shard's tensors into one flat buffer in shared memory (one file descriptor crosses the pipe, not
one per tensor); the child cuts its own tensors back out of it (fresh copies) and drops the buffer, so afterwards
each process holds only its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedShard:
    buffer: torch.Tensor  # [sum of numels] in shared memory, of the engine's dtype
    manifest: tuple[tuple[str, int, tuple[int, ...]], ...]  # (name, offset, shape) in buffer order


def share(shard: dict[str, torch.Tensor], dtype: torch.dtype) -> SharedShard:
    """`shard` (CPU tensors) in one shared buffer of `dtype`."""
    total = sum(t.numel() for t in shard.values())
    buffer = torch.empty(total, dtype=dtype).share_memory_()
    manifest = []
    offset = 0
    for name, tensor in shard.items():
        buffer[offset : offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        manifest.append((name, offset, tuple(tensor.shape)))
        offset += tensor.numel()
    return SharedShard(buffer=buffer, manifest=tuple(manifest))


def unshare(shared: SharedShard, device: torch.device) -> dict[str, torch.Tensor]:
    """The shard's tensors, copied out of the shared buffer onto `device` (the buffer is the caller's to drop)."""
    out = {}
    for name, offset, shape in shared.manifest:
        numel = 1
        for size in shape:
            numel *= size
        view = shared.buffer[offset : offset + numel].view(shape)
        out[name] = view.clone() if device.type == "cpu" else view.to(device)
    return out
