"""A rank's weight shard, handed from rank 0 to a child through shared memory.

Each tensor of the shard is copied into its own shared-memory segment and crosses the pipe
as a file descriptor; the child uses it as it is (a oneDNN-packed layer copies it and drops it). Once the child has
built its model, rank 0 drops its references: from then on each segment belongs to the child alone, so each process
holds only its own shard.
"""

from __future__ import annotations

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory pickling of tensors for the pipes


def share(shard: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A copy of `shard` (CPU tensors) in shared memory, in `dtype`; `shard` is emptied as it goes (a tensor only it
    held is freed once copied)."""
    shared = {}
    for name in list(shard):
        tensor = shard.pop(name)
        shared[name] = torch.empty(tensor.shape, dtype=dtype).share_memory_().copy_(tensor)
    return shared


def unshare(shared: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The shard's tensors on `device` (on cpu the shared tensors themselves)."""
    if device.type == "cpu":
        return shared
    return {name: tensor.to(device) for name, tensor in shared.items()}
