"""A child rank's life (ranks 1..N-1 of a tensor-parallel engine), in its own spawned process:

    watch rank 0 (its death ends this process at once) → join the group → take the weight shard → build the model
    and the KV cache shard (handed to rank 0 with Ready: shared memory on cpu, a CUDA IPC handle on a GPU, so that
    a worker's KV handoffs reach this rank's heads) → serve the KV lanes' control pipe on a thread (over gRPC this
    rank sends and receives its own heads: kv_transfer/rank_lanes.py) → report ready → loop: Forward / Logits /
    CaptureGraphs / Replay from rank 0 → Shutdown

Any failure (a collective that fails because a rank died, a broken pipe, an error in the forward) ends the process
with a non-zero exit code; rank 0 sees it and fails its engine. Nothing here schedules or samples: a child only
computes what rank 0 tells it to, in the same order, so that every collective meets its peers.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """What a child needs to build its part of the engine (picklable; no I/O)."""

    rank: int
    world_size: int
    store_port: int
    timeout_s: float
    device: str
    dtype: str  # concrete: float32, bfloat16, float16
    num_threads: int
    model_config: ModelConfig  # the rank's local shape (engine/distributed/sharding.py)
    max_positions: int
    num_kv_blocks: int
    block_size: int
    kv_cache_dtype: str
    attention_backend: str  # the backend rank 0 chose (concrete, never "auto")
    shm: bool = False  # rank 0 hands over the shared memory of the group's cpu collectives (shm_collectives.py)


@dataclass(frozen=True)
class Hello:
    pid: int


@dataclass(frozen=True)
class Ready:
    weight_bytes: int  # what this rank's model holds
    kv_cache_bytes: int
    # The rank's paged KV cache (and int8 scales), shared with rank 0 (shared memory on cpu, CUDA IPC on a GPU): rank
    # 0's worker reads and writes this rank's KV heads of a handoff's blocks through them (kv_transfer/tp_slices.py).
    kv_cache: object = None
    kv_scales: object = None


def run_rank(spec: RankSpec, conn: Connection, lanes_conn: Connection) -> None:
    """The child's entry point (multiprocessing spawn target). `lanes_conn`: the rank's control pipe for KV lanes
    (kv_transfer/rank_lanes.py), served on a thread of its own once the rank holds its cache."""
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
    try:
        _serve(spec, conn, lanes_conn)
    except (EOFError, BrokenPipeError):  # rank 0 went away: nothing to report to
        os._exit(1)
    except BaseException as exc:
        if _closed_by_rank_0(exc):  # rank 0 reports why; a traceback here would only repeat it
            logger.warning("tensor-parallel rank %d stopped: %s", spec.rank, exc)
            os._exit(1)
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        os._exit(1)
    os._exit(0)  # no atexit handlers, no group teardown waiting on dead peers


def _serve(spec: RankSpec, conn: Connection, lanes_conn: Connection) -> None:
    import torch

    from engine.attention.backend import get_attention_backend
    from engine.device import TORCH_DTYPES
    from engine.distributed import step_message
    from engine.distributed.group import make_group, make_store
    from engine.distributed.lora_shards import adapter_of
    from engine.distributed.shared_weights import unshare
    from engine.lora.adapter import LoRAAdapter
    from engine.lora.lora_step import LoRAStep
    from engine.model.llama import LlamaModel
    from engine.model_runner import allocate_kv_cache

    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and every default allocation on this rank's GPU
    conn.send(Hello(pid=os.getpid()))
    shm_fd = None
    if spec.shm:
        from multiprocessing import reduction

        shm_fd = reduction.recv_handle(conn)
    store = make_store(rank=spec.rank, world_size=spec.world_size, port=spec.store_port, timeout_s=spec.timeout_s)
    group = make_group(store, rank=spec.rank, world_size=spec.world_size, device=device, timeout_s=spec.timeout_s,
                       shm_fd=shm_fd)
    if shm_fd is not None:
        os.close(shm_fd)  # mapped
    weights = unshare(conn.recv(), device)
    if device.type == "cpu":
        from engine.kernels.registry import load_all

        load_all()
    c = spec.model_config
    attention = get_attention_backend(spec.attention_backend, scale=c.head_dim**-0.5, device=device,
                                      kv_cache_dtype=spec.kv_cache_dtype)
    assert all(t.dtype == TORCH_DTYPES[spec.dtype] for t in weights.values() if isinstance(t, torch.Tensor))
    model = LlamaModel(c, weights, attention, max_positions=spec.max_positions, group=group)
    del weights
    kv_cache, kv_scales, kv_caches = allocate_kv_cache(model, spec.num_kv_blocks, spec.block_size,
                                                       spec.kv_cache_dtype)
    kv_bytes = kv_cache.numel() * kv_cache.element_size() + (
        0 if kv_scales is None else kv_scales.numel() * kv_scales.element_size())
    if device.type == "cpu":  # moved in place: the per-layer views the forward takes follow their storage
        kv_cache.share_memory_()
        if kv_scales is not None:
            kv_scales.share_memory_()
    from kv_transfer.child_lanes import ChildLanes

    ChildLanes(lanes_conn, rank=spec.rank, device=device, kv_cache=kv_cache,
               kv_scales=kv_scales).serve_in_background()
    # To rank 0: shared memory on cpu, a CUDA IPC handle on a GPU (torch.multiprocessing's pickling of the pipe),
    # kept valid by this process holding the cache for its life.
    conn.send(Ready(weight_bytes=model_weight_bytes(model), kv_cache_bytes=kv_bytes, kv_cache=kv_cache,
                    kv_scales=kv_scales))
    drafts: dict[int, LlamaModel] = {}  # a layer-skip draft's cut of the model, by its number of layers
    adapters: dict[int, LoRAAdapter] = {}  # this rank's shards of the LoRA adapters, by rank 0's key
    graphs = None  # the decode step's CUDA graphs (engine/cuda_graphs.py), once rank 0 has them captured
    with torch.inference_mode():
        while True:
            message = step_message.decode(conn.recv_bytes(), device)
            if isinstance(message, step_message.Replay):
                assert graphs is not None, "a graph replayed before any was captured"
                graphs.replay_inputs(message.input_ids.numpy(), message.positions.numpy(), message.slots.numpy(),
                                     message.block_tables.numpy())
            elif isinstance(message, step_message.CaptureGraphs):
                from engine.cuda_graphs import DecodeGraphs

                graphs = DecodeGraphs(model, kv_caches, block_size=message.block_size,
                                      max_seq_len=message.max_seq_len, sizes=message.sizes)
                graphs.capture()
            elif isinstance(message, step_message.Forward) and message.num_layers:
                k = message.num_layers
                draft = drafts.get(k) or drafts.setdefault(k, model.first_layers(k))
                draft.forward(message.input_ids, message.positions, kv_caches[:k], message.meta)
            elif isinstance(message, step_message.Forward):
                lora = None
                if message.lora:  # the step's runs under LoRA adapters, each by the key rank 0 gave it
                    lora = LoRAStep([(adapters[key], start, end) for key, start, end in message.lora],
                                    message.lora_rows)
                model.forward(message.input_ids, message.positions, kv_caches, message.meta, lora)
            elif isinstance(message, step_message.LoadLoRA):
                adapters[message.key] = adapter_of(message)
            elif isinstance(message, step_message.UnloadLoRA):
                adapters.pop(message.key, None)
            elif isinstance(message, step_message.Logits):
                model.compute_logits(message.hidden)
            else:
                return


def _closed_by_rank_0(exc: BaseException) -> bool:
    from engine.distributed.shm_collectives import GroupClosed

    return isinstance(exc, GroupClosed)


def model_weight_bytes(model: object) -> int:
    """Bytes of the weight tensors `model` (a LlamaModel) holds, each storage counted once (a tied head shares the
    embedding's)."""
    import torch

    from engine.kernels.quantized_weight import QuantizedWeight

    seen: set[int] = set()
    total = 0

    def add(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if tensor is None:
            return
        if tensor.is_mkldnn or tensor.layout != torch.strided or _opaque(tensor):  # a oneDNN-packed weight
            key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
        else:
            key, nbytes = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        if key in seen:
            return
        seen.add(key)
        total += nbytes

    def add_weight(weight: torch.Tensor | QuantizedWeight | None) -> None:
        if isinstance(weight, QuantizedWeight):  # --quantization
            add(weight.data)
            add(weight.scales)
        else:
            add(weight)

    def add_linear(linear: object) -> None:
        add(getattr(linear, "packed", None))
        add(getattr(linear, "weight", None))
        add(getattr(linear, "bias", None))
        add_weight(getattr(linear, "quantized", None))

    add_weight(model.embed)  # type: ignore[attr-defined]  # a float table, or the tied Q8_0 head (counted once)
    add(model.final_norm)  # type: ignore[attr-defined]
    add_linear(model.lm_head)  # type: ignore[attr-defined]
    for layer in model.layers:  # type: ignore[attr-defined]
        add(layer.input_norm)
        add(layer.post_norm)
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            add_linear(linear)
    return total


def _opaque(tensor: object) -> bool:
    try:
        tensor.untyped_storage()  # type: ignore[attr-defined]
    except (NotImplementedError, RuntimeError):
        return True
    return False


def _exit_with_parent() -> None:
    """End this process the moment rank 0's process ends, however it ends (SIGKILL included): a daemon thread
    waits on the parent's sentinel, which multiprocessing's spawn hands every child. No orphan rank, ever."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
