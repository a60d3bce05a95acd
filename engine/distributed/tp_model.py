"""The model rank 0's runner drives at TP > 1: rank 0's own shard of the model, and its children kept in step.

`TensorParallelModel` has the model interface the runner uses (`forward`, `compute_logits`, `config`, `dtype`,
`device`): each call first sends the children the same call (engine/distributed/step_message.py), then runs rank
0's shard, whose collectives meet theirs. `config` is rank 0's local shape, so the runner's KV cache is rank 0's
shard of it (its KV heads, every block id); logits come back whole, gathered on rank 0.

Any failure inside a call (a rank died: its sockets close and the collective raises; a pipe broke; a collective
timed out) fails the group for good: the call and every later one raise RankDiedError naming the dead rank, so the
engine errors its requests (and frees their blocks) instead of hanging.

`launch_tensor_parallel` starts the whole thing from a loaded checkpoint.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.distributed import shm_collectives, step_message
from engine.distributed.group import rank_devices
from engine.distributed.lora_shards import RankAdapters
from engine.distributed.rank_group import RankDiedError, RankGroup, start_store
from engine.distributed.rank_worker import RankSpec, model_weight_bytes
from engine.distributed.sharding import local_model_config, shard_all, shard_weights
from engine.distributed.tp_sizes import TPShape
from engine.lora.lora_step import LoRAStep
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel

# A collective (and so a step) waits this long for a rank that neither answers nor dies (a hung rank); a rank that
# dies fails it at once. Generous: a long prefill chunk on a busy CPU takes seconds between two collectives.
COLLECTIVE_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 300.0  # spawning, importing torch, joining the group, building the shard

T = TypeVar("T")


class TensorParallelModel:
    def __init__(self, local: LlamaModel, ranks: RankGroup, shape: TPShape, whole: ModelConfig) -> None:
        self.local = local
        self.ranks = ranks
        self.shape = shape
        self.config = local.config  # rank 0's local shape; vocab_size is the whole vocabulary
        self.lora_shards = RankAdapters(whole, shape)  # LoRA adapters' shards on every rank (--enable-lora)
        self._finalizer = weakref.finalize(self, ranks.close)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def group(self):  # noqa: ANN201 - the TPGroup (its collective timer)
        return self.local.group

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, lora: LoRAStep | None = None) -> torch.Tensor:
        self.lora_shards.flush(self.ranks.send_each)  # adapters loaded or gone since the last step
        segments, rows = self.lora_shards.wire(lora) if lora is not None else ((), None)
        return self._in_step(step_message.Forward(input_ids, positions, meta, lora=segments, lora_rows=rows),
                             lambda: self.local.forward(input_ids, positions, kv_caches, meta, lora))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._in_step(step_message.Logits(hidden), lambda: self.local.compute_logits(hidden))

    def capture_graphs(self, run: Callable[[], float], *, sizes: Sequence[int], max_seq_len: int,
                       block_size: int) -> float:
        """Have every child capture its decode-step CUDA graphs (engine/cuda_graphs.py) while rank 0's `run`
        captures its own, bucket for bucket in the same order."""
        return self._in_step(step_message.CaptureGraphs(tuple(sizes), max_seq_len, block_size), run)

    def replay_graph(self, run: Callable[[], torch.Tensor], *, input_ids: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Send every child one decode step's inputs to replay its graph with, then replay rank 0's (`run`)."""
        return self._in_step(step_message.Replay(input_ids, positions, slots, block_tables), run)

    def first_layers(self, num_layers: int) -> _FirstLayers:
        """A layer-skip draft over every rank: each forward runs every rank's first `num_layers` layers (their
        all-reduces meeting as in the whole model's), the logits as the whole model's."""
        return _FirstLayers(self, self.local.first_layers(num_layers), num_layers)

    def _in_step(self, message: step_message.StepMessage, run: Callable[[], T]) -> T:
        self.ranks.check()
        self.ranks.send(message)
        try:
            return run()
        except Exception as exc:  # the ranks are out of lockstep now, whatever failed
            raise self.ranks.fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

    def rank_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """Ranks 1..N-1's paged KV caches (and int8 scales), mapped into this process (shared memory on cpu, CUDA
        IPC on a GPU), in rank order; None if a child did not share its own."""
        caches = [(ready.kv_cache, ready.kv_scales) for ready in self.ranks.ready]
        if any(cache is None for cache, _ in caches):
            return None
        return caches  # type: ignore[return-value]

    def weight_bytes(self) -> list[int]:
        """Bytes of weights each rank holds, rank 0 first."""
        return [model_weight_bytes(self.local)] + [ready.weight_bytes for ready in self.ranks.ready]

    def close(self) -> None:
        """Stop the children (idempotent); the model cannot run afterwards."""
        self._finalizer()


class _FirstLayers(TensorParallelModel):
    """`TensorParallelModel.first_layers`: the model interface a drafter uses (`forward`, `compute_logits`) over the
    whole model's ranks; it owns none of them (closing the whole model stops them)."""

    def __init__(self, whole: TensorParallelModel, local: LlamaModel, num_layers: int) -> None:
        self.local = local  # rank 0's shard, cut (its final norm and head are the whole model's)
        self.ranks, self.shape, self.config = whole.ranks, whole.shape, whole.config
        self.num_layers = num_layers

    def close(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        return self._in_step(step_message.Forward(input_ids, positions, meta, self.num_layers),
                             lambda: self.local.forward(input_ids, positions, kv_caches, meta))


def launch_tensor_parallel(
    *, config: ModelConfig, weights: dict[str, torch.Tensor], shape: TPShape, attention: AttentionBackend,
    device: torch.device, dtype: torch.dtype, dtype_name: str, max_model_len: int, num_kv_blocks: int,
    block_size: int, kv_cache_dtype: str, num_threads: int, consume_weights: bool = False,
) -> TensorParallelModel:
    """Start a TP-`shape.tp_size` model over the whole `weights` (HF names, any dtype, CPU): children for ranks
    1..N-1, each handed its shard, and rank 0's shard here. With `consume_weights` (a checkpoint nobody else holds)
    `weights` is emptied as it is cut, so that the whole model is held once at most; without, each rank's shard is
    cut from it in turn. Raises RankDiedError if a child fails to start."""
    world_size = shape.tp_size
    local_config = local_model_config(config, shape)
    devices = rank_devices(device, world_size)
    store, port = start_store(world_size, STARTUP_TIMEOUT_S)
    shm_file = shm_collectives.create(world_size) if device.type == "cpu" and shm_collectives.supported() else None
    specs = [
        RankSpec(rank=rank, world_size=world_size, store_port=port, timeout_s=COLLECTIVE_TIMEOUT_S,
                 device=str(devices[rank]), dtype=dtype_name, num_threads=num_threads, model_config=local_config,
                 max_positions=max_model_len, num_kv_blocks=num_kv_blocks, block_size=block_size,
                 kv_cache_dtype=kv_cache_dtype, attention_backend=_backend_flag(attention, kv_cache_dtype),
                 shm=shm_file is not None)
        for rank in range(1, world_size)
    ]
    ranks = RankGroup(specs, device=device, dtype=dtype, timeout_s=COLLECTIVE_TIMEOUT_S,
                      startup_timeout_s=STARTUP_TIMEOUT_S, shm_file=shm_file)
    if consume_weights:
        try:
            shards = shard_all(weights, config, shape)
        except BaseException:
            ranks.close()  # the collectives' memory too
            raise

        def shard(rank: int) -> dict[str, torch.Tensor]:
            mine, shards[rank] = shards[rank], {}
            return mine
    else:
        def shard(rank: int) -> dict[str, torch.Tensor]:
            return shard_weights(weights, config, shape, rank)

    group = ranks.start(store, shard)
    try:
        mine = {name: t.to(device=device, dtype=dtype) if isinstance(t, torch.Tensor) else t.to(device)
                for name, t in shard(0).items()}  # a quantized weight keeps its own dtypes
        local = LlamaModel(local_config, mine, attention, max_positions=max_model_len, group=group)
    except BaseException:
        ranks.close()
        raise
    return TensorParallelModel(local, ranks, shape, config)


def _backend_flag(attention: AttentionBackend, kv_cache_dtype: str) -> str:
    """The `--attention-backend` value that makes a child choose the backend rank 0 has (an int8 cache's backend is
    named apart, but "torch" is how one asks for it)."""
    return "torch" if kv_cache_dtype == "int8" else attention.name


__all__ = ["RankDiedError", "TensorParallelModel", "launch_tensor_parallel"]
