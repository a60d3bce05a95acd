"""The LoRA adapters an engine serves (vLLM's --enable-lora, --lora-modules, --max-lora-rank, --max-cpu-loras):
registered at start-up or at run time, looked up by name per request.

An adapter is registered once its files have loaded and passed every check (so a bad one is an error at start-up,
or at its run-time load, never at a request); its name, path and digest stay. Its weights are resident on the
engine's device in the model's dtype: all of them, or with `max_cpu_loras` the most recently used that many, the
others read from their files again when a request names them (vLLM's LRU of adapters in memory). Files that
changed since registration (another digest) are refused then, not served.

Requests hold their adapter itself (Request.lora), so an adapter unloaded or evicted while requests run under it
stays alive until they finish; a request naming an adapter no longer registered is refused at admission.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.lora.adapter import LoRAAdapter, LoRAError, load_lora_adapter
from engine.model.config import ModelConfig
from engine.request.lora import LoRARequest, check_lora_name


class AdapterShards(Protocol):
    def prepare(self, adapter: LoRAAdapter) -> LoRAAdapter: ...


@dataclass(frozen=True)
class Registered:
    """A registered adapter, resident or not."""

    name: str
    path: str
    digest: str


class LoRARegistry:
    def __init__(self, config: ModelConfig, *, device: torch.device, dtype: torch.dtype, max_lora_rank: int,
                 max_cpu_loras: int | None = None, shard: AdapterShards | None = None) -> None:
        """`config`: the whole model's shape (adapters are loaded for TP 1); `max_cpu_loras`: the most adapters
        resident at once (None: every registered one); `shard` at tensor_parallel_size > 1: what cuts each adapter
        into every rank's shard and keeps rank 0's (engine/distributed/lora_shards.py)."""
        self.config = config
        self.device = device
        self.dtype = dtype
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._shard = shard
        self._registered: dict[str, Registered] = {}
        self._resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        # Every adapter object still alive (resident, or evicted while requests hold it): brought back rather than
        # read again, so that one adapter is one object (the scheduler and the ranks count adapters by identity).
        self._live: weakref.WeakValueDictionary[str, LoRAAdapter] = weakref.WeakValueDictionary()
        self.num_loads = 0  # adapters read from their files, at registration and again after an eviction
        # Registrations, unloads and lookups come from the worker's event loop, its threads and the engine's. Held
        # only to read or change the maps: files are read outside it.
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load and register an adapter. LoRAError: it cannot load, or the name is taken."""
        check_lora_name(name)
        with self._lock:
            self._check_free(name)
        adapter = self._read(name, str(path))
        with self._lock:
            self._check_free(name)  # taken meanwhile
            self._registered[name] = Registered(name=name, path=str(path), digest=adapter.digest)
            self._keep(adapter)
        return adapter

    def resolve(self, request: LoRARequest) -> str:
        """The name of `request`'s adapter, registered first if it is not yet; LoRAError when that name is
        registered from another path."""
        with self._lock:
            registered = self._registered.get(request.lora_name)
        if registered is None:
            return self.load(request.lora_name, request.lora_path).name
        if registered.path != str(request.lora_path):
            raise LoRAError(f"LoRA adapter {request.lora_name!r} is loaded from {registered.path}, not "
                            f"{request.lora_path}")
        return registered.name

    def unload(self, name: str) -> None:
        """LoRAError when no adapter has that name. Requests already running under it finish with it."""
        with self._lock:
            if self._registered.pop(name, None) is None:
                raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
            self._resident.pop(name, None)
            self._live.pop(name, None)

    def get(self, name: str) -> LoRAAdapter:
        """The adapter's weights, read again from its files if it was evicted and nothing holds it any longer
        (LoRAError if they changed since it was registered)."""
        with self._lock:
            registered = self._registered_or_error(name)
            adapter = self._live.get(name)
            if adapter is not None:
                self._keep(adapter)
                return adapter
        adapter = self._read(name, registered.path, digest=registered.digest)
        with self._lock:
            if self._registered.get(name) is not registered:
                raise LoRAError(f"LoRA adapter {name!r} was unloaded meanwhile")
            adapter = self._live.get(name) or adapter  # another thread read it meanwhile: one object
            self._keep(adapter)
            return adapter

    def resident(self, name: str) -> bool:
        """Whether `get(name)` answers without reading files (an unknown name answers at once too)."""
        with self._lock:
            return name in self._live or name not in self._registered

    def adapters(self) -> list[Registered]:
        """Every registered adapter, resident or not, by name."""
        with self._lock:
            return sorted(self._registered.values(), key=lambda a: a.name)

    def _check_free(self, name: str) -> None:
        if name in self._registered:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")

    def _registered_or_error(self, name: str) -> Registered:
        registered = self._registered.get(name)
        if registered is None:
            loaded = ", ".join(sorted(self._registered)) or "none"
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return registered

    def _read(self, name: str, path: str, *, digest: str | None = None) -> LoRAAdapter:
        adapter = load_lora_adapter(name, path, self.config, max_lora_rank=self.max_lora_rank)
        if digest is not None and adapter.digest != digest:
            raise LoRAError(f"LoRA adapter {name!r}: the files in {path} changed since it was loaded (unload it and "
                            "load it again)")
        self.num_loads += 1
        adapter = adapter.to(self.device, self.dtype)
        return adapter if self._shard is None else self._shard.prepare(adapter)

    def _keep(self, adapter: LoRAAdapter) -> None:
        """`adapter` resident and most recently used; the least recently used beyond max_cpu_loras let go of."""
        self._live[adapter.name] = adapter
        self._resident[adapter.name] = adapter
        self._resident.move_to_end(adapter.name)
        while self.max_cpu_loras is not None and len(self._resident) > self.max_cpu_loras:
            self._resident.popitem(last=False)
