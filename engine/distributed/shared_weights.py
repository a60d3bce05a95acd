"""A rank's weight shard, handed from rank 0 to a child through shared memory.

Each tensor of the shard is copied into its own shared-memory segment and crosses the pipe
as a file descriptor; the child uses it as it is (a oneDNN-packed layer copies it and drops it). Once the child has
built its model, rank 0 drops its references: from then on each segment belongs to the child alone, so each process
holds only its own shard.
"""

from __future__ import annotations

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory pickling of tensors for the pipes

from engine.kernels.quantized_weight import QuantizedWeight
from engine.model.quantization import Weight


def share(shard: dict[str, Weight], dtype: torch.dtype) -> dict[str, Weight]:
    """A copy of `shard` (CPU tensors) in shared memory, in `dtype` (a quantized weight: its own dtypes); `shard` is
    emptied as it goes (a tensor only it held is freed once copied)."""
    shared: dict[str, Weight] = {}
    for name in list(shard):
        tensor = shard.pop(name)
        if isinstance(tensor, QuantizedWeight):
            shared[name] = QuantizedWeight(format=tensor.format, data=_shared_copy(tensor.data),
                                           in_features=tensor.in_features,
                                           scales=None if tensor.scales is None else _shared_copy(tensor.scales))
        else:
            shared[name] = torch.empty(tensor.shape, dtype=dtype).share_memory_().copy_(tensor)
    return shared


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_().copy_(tensor)


def unshare(shared: dict[str, Weight], device: torch.device) -> dict[str, Weight]:
    """The shard's tensors (and quantized weights) on `device` (on cpu the shared ones themselves)."""
    if device.type == "cpu":
        return shared
    return {name: t.to(device) for name, t in shared.items()}
