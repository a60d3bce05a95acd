"""Chained KV block hashes — the one function the engine's prefix cache, the KV events and the router share.

    root = H(json ["splitserve-kv-v1", model, block_size, kv_dtype])     the namespace (JSON: no separator clashes)
    h[0] = H(root | tokens[0 : B])
    h[i] = H(h[i-1] | tokens[i*B : (i+1)*B])                            only full blocks get a hash

A request through a LoRA adapter chains from its own root instead, `adapter_root(namespace, adapter digest)`: its
KV differs from the base model's for the same tokens (the adapter changes k and v), so its blocks never match
another adapter's or the base model's, in the prefix cache, the index, the tiers and a peer fetch alike. The
namespace (the index's keys, a tier's directory) stays the worker's.

Each hash covers the whole prefix before it, so equal hashes mean equal prefixes (up to a 128-bit collision).
The hash is SHA-256 over fixed-width little-endian token ids, truncated to 16 bytes: deterministic across
processes, machines and Python versions (never Python's seeded `hash()`). Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # 16 bytes
HASH_SIZE_BYTES = 16


@dataclass(frozen=True, kw_only=True)
class BlockHashNamespace:
    """What makes two caches' blocks interchangeable: the same weights, block size and KV dtype."""

    model: str
    block_size: int
    kv_dtype: str

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def root(self) -> BlockHash:
        key = json.dumps(["splitserve-kv-v1", self.model, self.block_size, self.kv_dtype]).encode()
        return hashlib.sha256(key).digest()[:HASH_SIZE_BYTES]


def adapter_root(namespace: BlockHashNamespace, adapter: str | None) -> BlockHash:
    """The root a request's chain starts from: the namespace's, or under a LoRA adapter (`adapter`: its digest,
    engine/lora/adapter.py) one of that adapter's own."""
    if adapter is None:
        return namespace.root
    return hashlib.sha256(namespace.root + b"lora\0" + adapter.encode()).digest()[:HASH_SIZE_BYTES]


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one block's token ids chained onto its parent's hash (the namespace root for block 0)."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(parent + payload).digest()[:HASH_SIZE_BYTES]


def extend_block_hashes(
    namespace: BlockHashNamespace, token_ids: Sequence[int], hashes: list[BlockHash], *, root: BlockHash | None = None
) -> list[BlockHash]:
    """Append to `hashes` the hashes of the full blocks of `token_ids` it does not cover yet; return it.

    Lets a request hash its blocks incrementally as tokens arrive, with no rehashing of earlier blocks. `root`:
    where block 0 chains from (`adapter_root`; default the namespace's).
    """
    block_size = namespace.block_size
    parent = hashes[-1] if hashes else (namespace.root if root is None else root)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def hash_token_blocks(namespace: BlockHashNamespace, token_ids: Sequence[int], *, root: BlockHash | None = None
                      ) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids` (from `root`, default the namespace's)."""
    return extend_block_hashes(namespace, token_ids, [], root=root)
