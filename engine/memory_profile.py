"""How many KV blocks a CUDA engine gets: `--gpu-memory-utilization` (vLLM's flag and rule).

On cuda, when neither `num_kv_blocks` nor `kv_cache_memory_bytes` is given, the KV cache gets what is left of this
engine's share of the GPU once the rest of the engine is paid for:

    kv bytes = total × utilization − peak torch bytes − non-torch bytes

    total               the GPU's memory (torch.cuda.mem_get_info)
    peak torch bytes    the most the torch allocator held for this engine (over the baseline, taken before its
                        weights went on the device) during a profile forward at the largest step: weights +
                        activations + logits (the load's transient copies are not counted: the peak restarts once
                        only the model holds the weights)
    non-torch bytes     what the device lost outside torch's allocator meanwhile (cuBLAS/cuDNN workspaces, kernel
                        modules): the drop in free memory not explained by the growth of torch.cuda.memory_reserved

The lifecycle, in `LLMEngine.__init__`:

    MemoryBaseline.take(device)        before any weight of this engine is on the device; checks that free memory
                                       is at least total × utilization (else another process holds the GPU)
    ... weights to the device, the model built ...
    profile_forward(model, ...)        max_num_batched_tokens dummy tokens as fresh prefill chunks of at most
                                       max_model_len tokens against a one-block scratch cache, then the sampler's
                                       float32 logits (softmax and sort, as top-p/top-k do) on the most rows a
                                       step samples
    baseline.measure()                 -> MemoryProfile (peak and non-torch bytes relative to the baseline)
    num_kv_blocks_for(profile, ...)    the pure arithmetic; a ValueError naming the figures and the flags to change
                                       when the share does not hold one max_model_len request

Everything is measured relative to the baseline, so an earlier engine still alive in the same process (a test run)
is neither counted nor double counted: its memory is in the allocator's count before the baseline, and the peak is
reset there. The CUDA context itself is made before the baseline and is not charged (as in vLLM); neither are CUDA
graph pools captured after the KV cache (issue 22, item 3): the 1 − utilization headroom covers them.

Two engines sharing one GPU (a prefill and a decode worker) each take `utilization` of the whole GPU, as in vLLM:
give each its share (e.g. 0.45), so that the second one's start finds the free memory it asks for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, PrefillChunk
from engine.model.llama import LlamaModel
from engine.model_runner import allocate_kv_cache

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class MemoryProfile:
    total_bytes: int  # the GPU's memory
    free_bytes_at_start: int  # free memory when the engine started (before its weights)
    weights_bytes: int  # the torch allocator's growth from the baseline to the model built (for the log)
    peak_torch_bytes: int  # the allocator's peak over the baseline, the profile forward included
    non_torch_bytes: int  # memory the device lost outside the torch allocator since the baseline


def kv_cache_bytes(*, total_bytes: int, utilization: float, peak_torch_bytes: int, non_torch_bytes: int) -> int:
    """Bytes left to the KV cache: total × utilization − peak torch − non-torch. May be ≤ 0 (the caller refuses)."""
    return int(total_bytes * utilization) - peak_torch_bytes - max(non_torch_bytes, 0)


def check_free_memory(*, free_bytes: int, total_bytes: int, utilization: float) -> None:
    """Refuse to start when the GPU's free memory is below this engine's share (another process holds it)."""
    wanted = int(total_bytes * utilization)
    if free_bytes < wanted:
        raise ValueError(
            f"free GPU memory at start-up ({_gib(free_bytes)} of {_gib(total_bytes)}) is less than "
            f"--gpu-memory-utilization {utilization} asks for ({_gib(wanted)}): another process (or engine) holds "
            "the GPU; lower --gpu-memory-utilization (engines sharing a GPU each take their own share of it, e.g. "
            "0.45 for each of two), or free the GPU"
        )


def num_kv_blocks_for(
    profile: MemoryProfile, *, utilization: float, block_bytes: int, block_size: int, max_model_len: int
) -> int:
    """The KV blocks that fit this engine's share of the GPU. Raises ValueError, naming the figures in GiB and what
    to change, when they are fewer than one request of max_model_len tokens needs."""
    budget = kv_cache_bytes(total_bytes=profile.total_bytes, utilization=utilization,
                            peak_torch_bytes=profile.peak_torch_bytes, non_torch_bytes=profile.non_torch_bytes)
    num_blocks = max(budget, 0) // block_bytes
    needed = math.ceil(max_model_len / block_size)
    if num_blocks < needed:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} leaves {_gib(budget)} for the KV cache "
            f"({_gib(profile.total_bytes)} × {utilization} = {_gib(int(profile.total_bytes * utilization))}, less "
            f"{_gib(profile.peak_torch_bytes)} peak during the profile forward (weights "
            f"{_gib(profile.weights_bytes)}), less {_gib(max(profile.non_torch_bytes, 0))} outside torch): "
            f"{num_blocks} blocks, but one request of max_model_len={max_model_len} needs {needed} blocks of "
            f"{block_size} tokens ({_gib(needed * block_bytes)}); raise --gpu-memory-utilization, or lower "
            "--max-model-len, --max-num-batched-tokens or --max-num-seqs (or give --kv-cache-memory / --num-kv-blocks)"
        )
    return num_blocks


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


class MemoryBaseline:
    """The device's memory before an engine puts anything on it; `measure()` after its profile forward."""

    def __init__(self, device: torch.device, *, utilization: float) -> None:
        self.device = device
        torch.cuda.empty_cache()  # cached but unused blocks (an earlier engine's) count as free
        self.free_bytes, self.total_bytes = torch.cuda.mem_get_info(device)
        check_free_memory(free_bytes=self.free_bytes, total_bytes=self.total_bytes, utilization=utilization)
        self.allocated_bytes = torch.cuda.memory_allocated(device)
        self.reserved_bytes = torch.cuda.memory_reserved(device)
        self.weights_bytes = 0
        torch.cuda.reset_peak_memory_stats(device)

    def weights_loaded(self) -> None:
        """Note what the model's weights take, once only the model holds them, and start the peak there: the
        load's transient copies (a tensor and its fused copy, both alive for a moment) are not the forward's."""
        self.weights_bytes = torch.cuda.memory_allocated(self.device) - self.allocated_bytes
        torch.cuda.reset_peak_memory_stats(self.device)

    def measure(self) -> MemoryProfile:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self.allocated_bytes
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        reserved_growth = torch.cuda.memory_reserved(self.device) - self.reserved_bytes
        profile = MemoryProfile(
            total_bytes=total_bytes,
            free_bytes_at_start=self.free_bytes,
            weights_bytes=self.weights_bytes,
            peak_torch_bytes=peak,
            non_torch_bytes=(self.free_bytes - free_bytes) - reserved_growth,
        )
        torch.cuda.empty_cache()  # the profile's activations go back to the device before the KV cache is made
        return profile


def profile_forward(
    model: LlamaModel, *, num_tokens: int, max_model_len: int, num_logit_rows: int, block_size: int,
    kv_cache_dtype: str = "auto",
) -> None:
    """The engine's largest step, for its memory: `num_tokens` dummy tokens as fresh prefill chunks of at most
    `max_model_len` tokens each, then the sampler's float32 logits on `num_logit_rows` rows (softmax and a full
    sort, what top-p/top-k allocate). Runs against a scratch cache of one block per layer: every token's slot is
    0 and every block table entry is block 0, so what is stored and read is garbage in a block nobody keeps (slot
    -1 is only the Triton kernel's padding convention; the torch and int8 backends index with the slots).
    Works on any device (the suite runs it on cpu)."""
    device = model.device
    chunk_lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    _, _, kv_caches = allocate_kv_cache(model, 1, block_size, kv_cache_dtype)  # one block per layer
    starts = [sum(chunk_lens[:i]) for i in range(len(chunk_lens))]
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int64, device=device),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64, device=device),
        prefills=tuple(PrefillChunk(query_start=start, query_len=n, context_len=n, context_slots=None)
                       for start, n in zip(starts, chunk_lens, strict=True)),
        # [num_chunks, blocks of the longest chunk], all block 0
        prefill_block_tables=torch.zeros(len(chunk_lens), math.ceil(max(chunk_lens) / block_size),
                                         dtype=torch.int64, device=device),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)  # [T]
    positions = torch.cat([torch.arange(n, device=device) for n in chunk_lens])  # [T]
    with torch.inference_mode():
        hidden = model.forward(input_ids, positions, kv_caches, meta)  # type: ignore[arg-type]  # [T, hidden]
        logits = model.compute_logits(hidden[: min(num_logit_rows, num_tokens)])  # [rows, vocab] float32
        probs = torch.softmax(logits, dim=-1)
        torch.sort(probs, dim=-1, descending=True)
