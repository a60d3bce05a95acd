"""The engine's KV tier below the device cache (`--kv-offload-dir`, `--kv-offload-memory`): the control-plane tier
(engine/core/kv_tier.py) over the runner's KV tensors.

    block pool evicts block b (hash h) ─▶ on_evict: copy kv_cache[:, :, b] (+ its int8 scales) to host bytes,
                                          offer them to the tier (its writer thread does the rest)
    scheduler admits a prompt ─▶ load(b, h): the tier's checked bytes ─▶ kv_cache[:, :, b]

One block's bytes: its KV across every layer, [num_layers, 2, block_size, num_kv_heads, head_dim] in the cache's
dtype, then for an int8 cache its scales [num_layers, 2, num_kv_heads] float32: every KV head, at any
tensor-parallel size (at TP N rank 0 gathers a block's heads from every rank's cache, which the child ranks share
with it, and scatters them back: kv_transfer/whole_blocks.py), so that a tier's entries are one model's
whatever the size that wrote them. A draft model's own KV is not kept: a loaded block is the target's, as a
prefix-cache hit is, and the draft catches up over it (engine/spec_decode/draft_model_proposer.py). On cuda at TP > 1
the children's caches are reached over CUDA IPC (its ordering: kv_transfer/whole_blocks.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.core.kv_tier import DirectoryStore, KVTier, KVTierError, MemoryStore
from kv_transfer.block_hash import BlockHash, BlockHashNamespace
from kv_transfer.layout import KVLayout
from kv_transfer.whole_blocks import WholeBlocks

logger = logging.getLogger(__name__)


class TierBlocks:
    """A `LowerTier` (engine/core/kv_cache_manager.py) over one KV cache, and the block pool's `on_evict`."""

    def __init__(self, tier: KVTier, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, *,
                 kind: str, whole: WholeBlocks | None = None) -> None:
        """`whole`: at tensor_parallel_size > 1, every rank's cache (a block's bytes are all its heads)."""
        self.tier = tier
        self.kind = kind  # "disk" or "host"
        self._kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self._kv_scales = kv_scales  # int8 only: [num_layers, 2, num_blocks, num_kv_heads]
        self._whole = whole
        self._kv_shape = whole.kv_shape if whole is not None else (*kv_cache.shape[:2], *kv_cache.shape[3:])
        self._kv_nbytes = math.prod(self._kv_shape) * kv_cache.element_size()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.tier

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """Copy an evicted block off the device cache, for the writer; skipped when the tier would not take it."""
        if self.tier.wants(block_hash):
            self.tier.offer(block_hash, self._snapshot(block_id))

    def load(self, block_id: int, block_hash: BlockHash) -> bool:
        payload = self.tier.read(block_hash)
        if payload is None:
            return False
        view = memoryview(payload)
        if view.readonly:
            view = memoryview(bytearray(view))
        kv = torch.frombuffer(view[:self._kv_nbytes], dtype=self._kv_cache.dtype).view(self._kv_shape)
        scales = None
        if self._kv_scales is not None:
            scales = torch.frombuffer(view[self._kv_nbytes:], dtype=self._kv_scales.dtype).view(
                *self._kv_shape[:2], -1)
        if self._whole is not None:
            self._whole.write(block_id, kv, scales)
            return True
        self._kv_cache[:, :, block_id].copy_(kv)
        if self._kv_scales is not None:
            self._kv_scales[:, :, block_id].copy_(scales)
        return True

    def _snapshot(self, block_id: int) -> memoryview:
        if self._whole is not None:
            kv, scales = self._whole.read(block_id)
        else:
            kv, scales = self._kv_cache[:, :, block_id], None if self._kv_scales is None else \
                self._kv_scales[:, :, block_id]
        parts = [_bytes_view(kv.to("cpu", copy=True).contiguous())]
        if scales is not None:
            parts.append(_bytes_view(scales.to("cpu", copy=True).contiguous()))
        return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))

    def write_back(self, blocks: list[tuple[int, BlockHash]], timeout_s: float = 10.0) -> int:
        """Queue the given device blocks (id, hash) the tier lacks, waiting for room, for `timeout_s` at most: a
        shutdown keeping its cache for the next start. Returns how many were queued."""
        deadline = time.monotonic() + timeout_s
        num_queued = 0
        for block_id, block_hash in blocks:
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                break
            if block_hash not in self.tier:
                num_queued += self.tier.offer(block_hash, self._snapshot(block_id), wait_s=wait_s)
        return num_queued

    def close(self) -> None:
        self.tier.close()


def block_nbytes(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> int:
    """The bytes of one block as the tier keeps it."""
    num_blocks = kv_cache.shape[2]
    return kv_cache.numel() // num_blocks * kv_cache.element_size() + _scales_nbytes(kv_scales)


def _scales_nbytes(kv_scales: torch.Tensor | None) -> int:
    if kv_scales is None:
        return 0
    return kv_scales.numel() // kv_scales.shape[2] * kv_scales.element_size()


def _bytes_view(t: torch.Tensor) -> memoryview:
    # The tensor's bytes, flat, without another copy (a cpu tensor of its own: nobody writes it afterwards).
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def check_tier_config(config: EngineConfig, device: torch.device) -> None:
    """ValueError for a tier this engine cannot run: called at start-up before anything loads."""
    if config.kv_offload_dir is None and config.kv_offload_memory_bytes is None:
        return
    if config.kv_offload_memory_bytes is not None:
        if device.type == "cpu":
            raise ValueError("--kv-offload-memory is a host-memory tier under a GPU's KV cache; on cpu the KV cache "
                             "is already in host memory (raise --kv-cache-memory, or use --kv-offload-dir)")
        if config.kv_offload_dir is not None:
            raise ValueError("--kv-offload-memory and --kv-offload-dir together are not built yet: give one")
    if not config.enable_prefix_caching:
        raise ValueError("a KV offload tier keeps blocks the prefix cache evicts: it needs --enable-prefix-caching")


def make_tier(config: EngineConfig, device: torch.device, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
              namespace: BlockHashNamespace, *, layout: KVLayout | None = None,
              ranks: Sequence[tuple[torch.Tensor, torch.Tensor | None]] | None = None) -> TierBlocks | None:
    """The tier `config` asks for (checked by `check_tier_config`), started: a directory's entries of this
    namespace found again. None without one. Raises KVTierError (a ValueError) for a directory it cannot use. At
    tensor_parallel_size > 1, `layout` is the engine's and `ranks` every rank's (kv_cache, kv_scales), rank 0 first
    (None: the children's caches are not mapped here, and the tier cannot reach their heads)."""
    check_tier_config(config, device)
    if config.kv_offload_dir is None and config.kv_offload_memory_bytes is None:
        return None
    whole = None
    if config.tensor_parallel_size > 1:
        if layout is None or ranks is None:
            raise KVTierError("a KV offload tier at --tensor-parallel-size > 1 needs every rank's KV cache, which "
                              "its child ranks did not share")
        whole = WholeBlocks(layout, ranks)
    nbytes = block_nbytes(kv_cache, kv_scales) if whole is None else whole.nbytes
    if config.kv_offload_dir is not None:
        assert config.kv_offload_size_bytes is not None  # EngineConfig checks it
        store: DirectoryStore | MemoryStore = DirectoryStore(config.kv_offload_dir, namespace)
        size, kind = config.kv_offload_size_bytes, "disk"
    else:
        assert config.kv_offload_memory_bytes is not None
        store, size, kind = MemoryStore(), config.kv_offload_memory_bytes, "host"
    if size < nbytes:
        store.close()
        raise KVTierError(f"the KV offload tier ({size} bytes) cannot hold one block ({nbytes} bytes)")
    tier = KVTier(store, namespace=namespace, size_bytes=size, block_nbytes=nbytes, name=f"kv-tier-{kind}")
    logger.info("KV offload tier (%s): %d blocks of %d bytes found, bound %.2f GiB", kind, len(tier), nbytes,
                size / (1 << 30))
    return TierBlocks(tier, kv_cache, kv_scales, kind=kind, whole=whole)
