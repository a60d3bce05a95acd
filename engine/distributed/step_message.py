"""What rank 0 sends its children, one message a call, over each child's pipe: bytes, so no tensor goes through
shared memory on the step's path.

    Forward(input_ids, positions, meta, num_layers, lora, lora_rows)
                                           run the model's forward over your shard (its KV writes
                                           included); num_layers > 0: its first num_layers layers only, then the
                                           final norm (a layer-skip draft's forward); lora: its tokens' LoRA
                                           adapters, by key (engine/lora/lora_step.py's runs)
    LoadLoRA(key, name, num_layers, pairs), UnloadLoRA(key)
                                           hold (forget) your shard of a LoRA adapter under this key
                                           (engine/distributed/lora_shards.py)
    Logits(hidden)                         compute your slice of the logits of these rows (rank 0 gathers them)
    CaptureGraphs(sizes, max_seq_len, block_size)
                                           capture your decode step's CUDA graphs, these buckets, in this order
                                           (engine/cuda_graphs.py: rank 0 captures its own meanwhile)
    Replay(input_ids, positions, slots, block_tables)
                                           replay your graph of this decode step's bucket over these inputs
    Shutdown()                             leave the loop and exit 0

Tensors travel as (dtype, shape, bytes) and come out on the receiver's device (Replay's on the host);
`AttentionMetadata` (its prefill chunks included) is rebuilt field by field.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.metadata import AttentionMetadata, PrefillChunk


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    num_layers: int = 0  # 0: every layer; k > 0: the first k (a layer-skip draft)
    lora: tuple[tuple[int, int, int], ...] = ()  # (adapter key, first token, end): LoRAStep.segments
    lora_rows: torch.Tensor | None = None  # LoRAStep.rows


@dataclass(frozen=True)
class LoadLoRA:
    key: int
    name: str
    num_layers: int
    pairs: tuple[tuple[int, str, torch.Tensor, torch.Tensor], ...]  # (layer, fused layer, A, B) of this rank's shard


@dataclass(frozen=True)
class UnloadLoRA:
    key: int


@dataclass(frozen=True)
class Logits:
    hidden: torch.Tensor  # [n, hidden]


@dataclass(frozen=True)
class CaptureGraphs:
    sizes: tuple[int, ...]  # the decode batch sizes, as rank 0's engine/cuda_graphs.DecodeGraphs takes them
    max_seq_len: int
    block_size: int


@dataclass(frozen=True)
class Replay:
    input_ids: torch.Tensor  # [n] int64, async scheduling's placeholders resolved
    positions: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [n, W] int64; a row's entries past its context may hold anything


@dataclass(frozen=True)
class Shutdown:
    pass


StepMessage = Forward | Logits | CaptureGraphs | Replay | LoadLoRA | UnloadLoRA | Shutdown


def encode(message: StepMessage) -> bytes:
    return pickle.dumps(_to_wire(message), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes, device: torch.device) -> StepMessage:
    return _from_wire(pickle.loads(data), device)


class _Wire:
    """A tensor on the wire."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.shape = tuple(tensor.shape)
        self.data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""

    def __getstate__(self) -> tuple[str, tuple[int, ...], bytes]:
        return self.dtype, self.shape, self.data

    def __setstate__(self, state: tuple[str, tuple[int, ...], bytes]) -> None:
        self.dtype, self.shape, self.data = state

    def tensor(self, device: torch.device) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype, device=device)
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dtype)
        out = flat.view(self.shape)
        return out if device.type == "cpu" else out.to(device)


def _to_wire(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Wire(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, tuple):
        return tuple(_to_wire(v) for v in value)
    return value


_TYPES: dict[str, type] = {t.__name__: t for t in (Forward, Logits, CaptureGraphs, Replay, LoadLoRA, UnloadLoRA,
                                                   Shutdown, AttentionMetadata, PrefillChunk)}


def _from_wire(value: Any, device: torch.device) -> Any:
    if isinstance(value, _Wire):
        return value.tensor(device)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], dict):
        cls = _TYPES[value[0]]
        if cls is Replay:  # its inputs stay on the host: the child's graph copies them into its own device buffer
            device = torch.device("cpu")
        return cls(**{name: _from_wire(v, device) for name, v in value[1].items()})
    if isinstance(value, tuple):
        return tuple(_from_wire(v, device) for v in value)
    return value
