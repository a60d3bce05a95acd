"""LoRA adapters at tensor_parallel_size > 1: each rank holds its shard of every adapter, cut as the weights are
(engine/distributed/sharding.py), and rank 0 names the adapters of each step's runs by key.

    fused pair        A [R, in]                       B [out, R] (block diagonal)
    qkv, gate_up      replicated (the input is whole)  rows of the rank's heads / intermediate range, per part
    o, down           columns of its heads / range     replicated: the partial delta joins the layer's own
                                                       partial output before its one all-reduce (llama.py)

so a rank's delta is computed on exactly the rows and columns its shard of the layer holds, and the row-parallel
layers need no collective of their own. Rank 0 cuts every rank's shard when an adapter loads (start-up or run
time, on any thread) and queues the children's; the engine thread sends what is queued before its next forward
(`flush`), on the children's pipes, so no load interleaves with a step's messages. An adapter's children's shards
go when rank 0's shard is collected (no registry entry and no request holds it any longer), again at a flush.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable

import torch

from engine.distributed import step_message
from engine.distributed.tp_sizes import TPShape
from engine.lora.adapter import LoRAAdapter, LoRAPair
from engine.lora.lora_step import LoRAStep
from engine.model.config import ModelConfig


def shard_adapter(adapter: LoRAAdapter, config: ModelConfig, shape: TPShape, rank: int) -> LoRAAdapter:
    """Rank `rank`'s shard of `adapter` (loaded for the whole model, `config`), in fresh memory."""
    d = config.head_dim
    q_size, kv_size, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    heads, kv_heads, inter_range = shape.head_range(rank), shape.kv_head_range(rank), shape.intermediate_range(rank)
    q_rows = torch.arange(heads.start * d, heads.stop * d)
    kv_rows = torch.arange(kv_heads.start * d, kv_heads.stop * d)
    inter_rows = torch.arange(inter_range.start, inter_range.stop)
    rows = {"qkv": torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows]),
            "gate_up": torch.cat([inter_rows, inter + inter_rows])}
    columns = {"o": q_rows, "down": inter_rows}

    def cut(fused: str, pair: LoRAPair) -> LoRAPair:
        if fused in rows:
            return LoRAPair(pair.a.clone(), pair.b.index_select(0, rows[fused].to(pair.b.device)))
        return LoRAPair(pair.a.index_select(1, columns[fused].to(pair.a.device)), pair.b.clone())

    layers = tuple({fused: cut(fused, pair) for fused, pair in layer.items()} for layer in adapter.layers)
    return LoRAAdapter(name=adapter.name, path=adapter.path, rank=adapter.rank, scaling=adapter.scaling,
                       digest=adapter.digest, target_modules=adapter.target_modules, layers=layers)


def load_message(key: int, adapter: LoRAAdapter) -> step_message.LoadLoRA:
    pairs = tuple((i, fused, pair.a, pair.b) for i, layer in enumerate(adapter.layers) for fused, pair in layer.items())
    return step_message.LoadLoRA(key=key, name=adapter.name, num_layers=len(adapter.layers), pairs=pairs)


def adapter_of(message: step_message.LoadLoRA) -> LoRAAdapter:
    """A child's shard, as `load_message` sent it."""
    layers: list[dict[str, LoRAPair]] = [{} for _ in range(message.num_layers)]
    for i, fused, a, b in message.pairs:
        layers[i][fused] = LoRAPair(a, b)
    return LoRAAdapter(name=message.name, path="", rank=0, scaling=0.0, digest="", target_modules=(),
                       layers=tuple(layers))


class RankAdapters:
    """Rank 0's bookkeeping of the adapters its children hold (module docstring)."""

    def __init__(self, config: ModelConfig, shape: TPShape) -> None:
        self.config = config  # the whole model's shape
        self.shape = shape
        self._keys: weakref.WeakKeyDictionary[LoRAAdapter, int] = weakref.WeakKeyDictionary()
        # The children's loads, encoded (their tensors copied to the host: none waits on rank 0's device), one
        # message per child, rank 1 first; and the keys whose adapters rank 0 has let go of. A deque's append is
        # atomic: a finalizer (which may run inside any allocation, a lock's holder included) takes no lock.
        self._loads: collections.deque[tuple[int, list[bytes]]] = collections.deque()
        self._gone: collections.deque[int] = collections.deque()
        self._next_key = itertools.count(1)

    def prepare(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Rank 0's shard of `adapter` (whole, on rank 0's device); the children's are queued for the next flush."""
        key = next(self._next_key)
        shards = [shard_adapter(adapter, self.config, self.shape, rank) for rank in range(self.shape.tp_size)]
        mine = shards[0]
        self._loads.append((key, [step_message.encode(load_message(key, shard)) for shard in shards[1:]]))
        self._keys[mine] = key
        weakref.finalize(mine, self._gone.append, key)
        return mine

    def flush(self, send_each: Callable[[list[bytes]], None]) -> None:
        """Send the children what is queued, on the engine thread between two steps' messages: the loads, then the
        unloads (a load whose adapter is already gone is not sent at all)."""
        gone: set[int] = set()
        while self._gone:
            gone.add(self._gone.popleft())
        while self._loads:
            key, messages = self._loads.popleft()
            if key in gone:
                gone.discard(key)
            else:
                send_each(messages)
        for key in sorted(gone):
            send_each([step_message.encode(step_message.UnloadLoRA(key))] * (self.shape.tp_size - 1))

    def wire(self, lora: LoRAStep) -> tuple[tuple[tuple[int, int, int], ...], torch.Tensor | None]:
        """A step's runs with each adapter named by its key, and the rows of its grouped tokens (or None)."""
        return tuple((self._keys[adapter], start, end) for adapter, start, end in lora.segments), lora.rows
