"""CUDA graphs of the decode step: the model's forward and its logits, captured once per batch-size bucket at
start-up and replayed for every step whose tokens are all single-token decodes.

On a GPU a small model's decode step is launch-bound: ~400 kernels, each costing tens of microseconds when Python
launches it, a few when a graph does. A replay needs fixed shapes and fixed addresses, so every input lives in one
static device buffer, sliced per bucket:

    flat (int64, on the GPU):  [ input_ids | positions | slot_mapping | seq_lens | block_tables (max_batch x W) ]
                                  max_batch   max_batch   max_batch      max_batch   W = cdiv(max_seq_len, block)

A step of n decodes takes the smallest bucket B >= n. The host writes the step into the same layout in pinned memory
and one asynchronous copy moves the part bucket B reads; rows n..B-1 are padding: slot -1 (store_kv writes nothing)
and length 0 (attention reads nothing), so they touch no block. The block tables are max_seq_len wide (the model's
context, capped by --max-seq-len-to-capture, vLLM's flag: 8192), which fixes the attention kernel's grid; its
partitions past a row's length exit at once; a step with a longer context runs eagerly. The step's one host
synchronisation is the sampler reading its tokens back; with async scheduling (engine/core/overlap.py) that read
comes after the next step is launched, whose placeholder input ids `run`'s `feed` writes on the device.

Graphs run only where every kernel of the step is capturable and free of host syncs: the Triton attention backend
with a cache in the model's dtype. `--enforce-eager` (vLLM's flag) turns them off; `--cuda-graph-sizes` (vLLM's)
names the buckets.

At tensor_parallel_size > 1 (NCCL only: gloo's collectives go through the host, which no graph holds) every rank
captures its own shard's step, its all-reduces and the logits gather inside: rank 0 passes its shard here with the
TensorParallelModel as `peers`, which has each child build the same buckets (engine/distributed/rank_worker.py) and
capture them in the same order, so the warm-up steps' collectives meet. Each replay sends the children the step's
inputs first (step_message.Replay: the placeholders already resolved, which reads them back from the device, as an
eager TP step does), then replays rank 0's graph; the children replay theirs, and the captured collectives meet.
Untested on hardware here: NCCL needs a GPU per rank, and the machines lent have one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.model.llama import LlamaModel

logger = logging.getLogger(__name__)

MAX_DEFAULT_CAPTURE_SIZE = 512  # vLLM's cap on the default buckets


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (capped at 512), max_num_seqs itself included."""
    top = min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)


class GraphPeers(Protocol):
    """The other ranks of a tensor-parallel model (engine/distributed/tp_model.py's TensorParallelModel): each call
    sends every child the same step first, then runs rank 0's part (`run`); a failure fails the whole group."""

    def capture_graphs(self, run: Callable[[], float], *, sizes: Sequence[int], max_seq_len: int,
                       block_size: int) -> float: ...

    def replay_graph(self, run: Callable[[], torch.Tensor], *, input_ids: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor: ...


class DecodeGraphs:
    """The captured decode steps of one model over one KV cache. Not thread-safe: the engine's step thread only.
    `peers`: at tensor_parallel_size > 1, rank 0's (with `model` its shard); a child's graphs have none."""

    def __init__(
        self, model: LlamaModel, kv_caches: Sequence[torch.Tensor], *, block_size: int, max_seq_len: int,
        sizes: Sequence[int], peers: GraphPeers | None = None,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cuda graph sizes must be positive batch sizes, got {list(sizes)}")
        self.model = model
        self.peers = peers
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.sizes = sorted(set(sizes))
        self.max_batch = mb = self.sizes[-1]
        self.max_seq_len = max_seq_len  # the longest context (new token included) a replay covers
        self.width = w = -(-max_seq_len // block_size)  # block-table columns
        device = model.device
        self._flat = torch.zeros(4 * mb + mb * w, dtype=torch.int64, device=device)
        self._host = torch.zeros(4 * mb + mb * w, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self._flat[: 4 * mb].view(4, mb).unbind(0)
        self.block_tables = self._flat[4 * mb :].view(mb, w)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | _EagerReplay, torch.Tensor]] = {}
        self._pool = None
        # The last step's input copy: the host buffer is free once it completed (recorded again every step).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._copy_pending = False
        self.num_replays = 0

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest captured batch size >= num_tokens, or None when the step is too large for any."""
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=batch,
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_seq_lens=self.seq_lens[:batch],
            prefills=(),
            prefill_block_tables=None,
        )

    @torch.inference_mode()
    def _step(self, batch: int) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._meta(batch))
        return self.model.compute_logits(hidden)  # [batch, vocab] float32 ([batch, 0] on a child: gathered on 0)

    def capture(self) -> float:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool). Returns the seconds it took.
        The inputs are all padding while capturing: no block is written. With `peers`, every child captures the
        same buckets in the same order meanwhile."""
        if self.peers is not None:
            return self.peers.capture_graphs(self._capture, sizes=self.sizes, max_seq_len=self.max_seq_len,
                                             block_size=self.block_size)
        return self._capture()

    def _capture(self) -> float:
        started = time.perf_counter()
        cuda = self.model.device.type == "cuda"
        self._fill_padding(0, self.max_batch)
        self._flat.copy_(self._host)
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        for batch in reversed(self.sizes):
            if not cuda:  # one eager step a bucket (a child rank's meets it: the same on every rank)
                eager = _EagerReplay(lambda b=batch: self._step(b))  # type: ignore[misc]
                self._graphs[batch] = (eager, eager.logits)
                continue
            self._step(batch)  # eager first: Triton compiles, cuBLAS picks its kernels, outside the capture
            torch.cuda.synchronize(self.model.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._step(batch)
            self._graphs[batch] = (graph, logits)
        if cuda:
            torch.cuda.synchronize(self.model.device)
        seconds = time.perf_counter() - started
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s", len(self.sizes),
                    self.max_batch, seconds)
        return seconds

    def _fill_padding(self, first: int, last: int) -> None:
        mb = self.max_batch
        h = self._host_np
        for column in (0, 1, 3):  # input ids, positions, lengths
            h[column * mb + first : column * mb + last] = 0
        h[2 * mb + first : 2 * mb + last] = -1  # slots: nothing stored

    def run(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            block_tables: Sequence[Sequence[int]], feed: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """One decode step of len(input_ids) sequences (each's one new token, its position < max_seq_len and cache
        slot, its block table); returns their logits [n, vocab] float32, a view that the next replay overwrites.
        `feed(input_ids)`, if given, writes input ids on the device (async scheduling's placeholders: the previous
        step's sampled tokens) into the graph's [n] input ids, after the host's are copied there."""
        n = len(input_ids)
        batch = self.load(input_ids, positions, slots, block_tables)
        if feed is not None:
            feed(self.input_ids[:n])
        self.num_replays += 1
        if self.peers is None:
            return self._replay(batch)[:n]
        mb, w = self.max_batch, self.width
        ids = self.input_ids[:n].cpu() if feed is not None else torch.from_numpy(self._host_np[:n].copy())
        used = max(min(len(table), w) for table in block_tables)
        tables = self._host_np[4 * mb : 4 * mb + n * w].reshape(n, w)[:, :used].copy()
        return self.peers.replay_graph(
            lambda: self._replay(batch), input_ids=ids, positions=torch.from_numpy(self._host_np[mb : mb + n].copy()),
            slots=torch.from_numpy(self._host_np[2 * mb : 2 * mb + n].copy()), block_tables=torch.from_numpy(tables),
        )[:n]

    def load(self, input_ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
             slots: Sequence[int] | np.ndarray, block_tables: Sequence[Sequence[int]] | np.ndarray) -> int:
        """Write one step's inputs into the graphs' device buffer (padding the rest of its bucket); returns the
        bucket. A block table's entries past its row's context are never read: they may hold anything."""
        n = len(input_ids)
        batch = self.bucket(n)
        if batch is None:
            raise ValueError(f"no CUDA graph captured for a batch of {n} (largest: {self.max_batch})")
        mb, w = self.max_batch, self.width
        if self._copied is not None and self._copy_pending:
            self._copied.synchronize()  # at once after the sampler's sync; else (no row sampled) the copy finishes
        h = self._host_np
        h[0:n] = input_ids
        h[mb : mb + n] = positions
        h[2 * mb : 2 * mb + n] = slots
        tables = h[4 * mb : 4 * mb + batch * w].reshape(batch, w)
        for row, table in enumerate(block_tables):  # blocks past max_seq_len (none a context reads) stay behind
            tables[row, : min(len(table), w)] = table[:w]
        h[3 * mb : 3 * mb + n] = h[mb : mb + n] + 1  # each row attends to its context and its new token
        self._fill_padding(n, batch)
        # Earlier replays may still read the device buffer: the copy is ordered after them on the same stream.
        end = 4 * mb + batch * w
        self._flat[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._copy_pending = True
        return batch

    def replay_inputs(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      block_tables: np.ndarray) -> None:
        """A child rank's step (step_message.Replay): rank 0's inputs into this rank's buffer, then its graph."""
        self.num_replays += 1
        self._replay(self.load(input_ids, positions, slots, block_tables))

    def _replay(self, batch: int) -> torch.Tensor:
        graph, logits = self._graphs[batch]
        graph.replay()
        return logits


class _EagerReplay:
    """On cpu, where the engine never captures (nothing to save: no launches), a bucket's "graph" is its eager step
    over the same static buffers, into the same logits: what lets the CPU tests run the buckets, the padding and
    the tensor-parallel ranks' lockstep replays (tests/engine/kernels/test_tp_decode_graphs.py)."""

    def __init__(self, step: Callable[[], torch.Tensor]) -> None:
        self._step = step
        self.logits = step()

    @torch.inference_mode()
    def replay(self) -> None:
        self.logits.copy_(self._step())
