"""The LoRA adapters an engine serves (vLLM's --enable-lora, --lora-modules, --max-lora-rank): loaded at start-up
or at run time, each on the engine's device in the model's dtype, looked up by name per request.

Requests hold their adapter itself (Request.lora), so an adapter unloaded while requests run under it stays alive
until they finish; a request naming an adapter no longer here is refused at admission.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from engine.lora.adapter import LoRAAdapter, LoRAError, load_lora_adapter
from engine.model.config import ModelConfig
from engine.request.lora import LoRARequest, check_lora_name


class AdapterShards(Protocol):
    def prepare(self, adapter: LoRAAdapter) -> LoRAAdapter: ...


class LoRARegistry:
    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype, max_lora_rank: int,
                 max_loras: int, shard: AdapterShards | None = None) -> None:
        """`config`: the whole model's shape (adapters are loaded for TP 1); `shard` at tensor_parallel_size > 1:
        what cuts each adapter into every rank's shard and keeps rank 0's (engine/distributed/lora_shards.py)."""
        self.config = config
        self.device = device
        self.dtype = dtype
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras  # the most adapters one step runs (the scheduler keeps to it)
        self._shard = shard
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()  # loads and unloads come from the worker's event loop, lookups from anywhere

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load and add an adapter. LoRAError: it cannot load, or the name is taken."""
        check_lora_name(name)
        if name in self._adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = load_lora_adapter(name, path, self.config, max_lora_rank=self.max_lora_rank).to(
            self.device, self.dtype)
        if self._shard is not None:
            adapter = self._shard.prepare(adapter)
        with self._lock:
            if name in self._adapters:
                raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")
            self._adapters = {**self._adapters, name: adapter}
        return adapter

    def resolve(self, request: LoRARequest) -> str:
        """The name of `request`'s adapter, loaded first if it is not yet; LoRAError when that name is loaded from
        another path."""
        adapter = self._adapters.get(request.lora_name)
        if adapter is None:
            return self.load(request.lora_name, request.lora_path).name
        if adapter.path != str(request.lora_path):
            raise LoRAError(f"LoRA adapter {request.lora_name!r} is loaded from {adapter.path}, not "
                            f"{request.lora_path}")
        return adapter.name

    def unload(self, name: str) -> None:
        """LoRAError when no adapter has that name. Requests already running under it finish with it."""
        with self._lock:
            if name not in self._adapters:
                raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
            self._adapters = {k: v for k, v in self._adapters.items() if k != name}

    def get(self, name: str) -> LoRAAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self._adapters)) or "none"
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return adapter

    def adapters(self) -> list[LoRAAdapter]:
        return sorted(self._adapters.values(), key=lambda a: a.name)
