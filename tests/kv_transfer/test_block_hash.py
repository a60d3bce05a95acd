"""Chained block hashes: deterministic across processes, chained, namespaced, full blocks only."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kv_transfer.block_hash import (
    HASH_SIZE_BYTES,
    BlockHashNamespace,
    extend_block_hashes,
    hash_block_tokens,
    hash_token_blocks,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

NS = BlockHashNamespace(model="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=4, kv_dtype="float16")
TOKENS = list(range(1, 10))  # 9 tokens: two full blocks of 4 and a partial one

# Computed once from the implementation and pinned: a change here breaks every published prefix index entry.
GOLDEN_ROOT = "4836475f79238c8cdda446003f0891f0"
GOLDEN_HASHES = ["d90169444d326db175a37d49530988e0", "b6dbac13e572349f8349c2e2a0e2df7c"]


def test_golden_values() -> None:
    assert NS.root.hex() == GOLDEN_ROOT
    assert [h.hex() for h in hash_token_blocks(NS, TOKENS)] == GOLDEN_HASHES


def test_matches_the_documented_formula() -> None:
    """root = H(json [version, model, B, dtype]), h[i] = H(h[i-1] | u32le tokens), SHA-256 truncated to 16."""

    def h(data: bytes) -> bytes:
        return hashlib.sha256(data).digest()[:16]

    root = h(b'["splitserve-kv-v1", "HuggingFaceTB/SmolLM2-135M-Instruct", 4, "float16"]')
    h0 = h(root + struct.pack("<4I", 1, 2, 3, 4))
    h1 = h(h0 + struct.pack("<4I", 5, 6, 7, 8))
    assert NS.root == root
    assert hash_token_blocks(NS, TOKENS) == [h0, h1]
    assert hash_block_tokens(root, [1, 2, 3, 4]) == h0
    assert HASH_SIZE_BYTES == 16
    assert all(len(x) == HASH_SIZE_BYTES for x in (root, h0, h1))


@pytest.mark.parametrize("seed", ["0", "1", "4242"])
def test_same_value_in_a_process_with_another_hash_seed(seed: str) -> None:
    code = (
        "from kv_transfer.block_hash import BlockHashNamespace, hash_token_blocks\n"
        "ns = BlockHashNamespace(model='HuggingFaceTB/SmolLM2-135M-Instruct', block_size=4, kv_dtype='float16')\n"
        "print(ns.root.hex(), *[h.hex() for h in hash_token_blocks(ns, list(range(1, 10)))])\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == [GOLDEN_ROOT, *GOLDEN_HASHES]


def test_chained_a_change_in_block_0_changes_every_later_hash() -> None:
    tokens = list(range(100, 116))  # 4 full blocks
    base = hash_token_blocks(NS, tokens)
    changed = hash_token_blocks(NS, [999, *tokens[1:]])
    assert len(base) == len(changed) == 4
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_a_change_in_block_2_keeps_earlier_hashes() -> None:
    tokens = list(range(100, 116))
    base = hash_token_blocks(NS, tokens)
    changed_tokens = list(tokens)
    changed_tokens[9] = 999  # inside block 2
    changed = hash_token_blocks(NS, changed_tokens)
    assert changed[:2] == base[:2]
    assert changed[2] != base[2]
    assert changed[3] != base[3]  # block 3's tokens are equal, but its parent is not


def test_same_block_tokens_at_different_positions_hash_differently() -> None:
    hashes = hash_token_blocks(NS, [7, 7, 7, 7] * 3)
    assert len(set(hashes)) == 3


@pytest.mark.parametrize(
    "other",
    [
        BlockHashNamespace(model="meta-llama/Llama-3.2-1B", block_size=4, kv_dtype="float16"),
        BlockHashNamespace(model="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=8, kv_dtype="float16"),
        BlockHashNamespace(model="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=4, kv_dtype="bfloat16"),
    ],
    ids=["model", "block_size", "kv_dtype"],
)
def test_namespaced_each_field_changes_the_hashes(other: BlockHashNamespace) -> None:
    tokens = list(range(1, 17))
    assert other.root != NS.root
    ours = hash_token_blocks(NS, tokens)
    theirs = hash_token_blocks(other, tokens)
    assert set(ours).isdisjoint(theirs)


def test_equal_namespaces_hash_equally() -> None:
    twin = BlockHashNamespace(model="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=4, kv_dtype="float16")
    assert twin == NS
    assert hash_token_blocks(twin, TOKENS) == hash_token_blocks(NS, TOKENS)


@pytest.mark.parametrize(("num_tokens", "num_hashes"), [(0, 0), (1, 0), (3, 0), (4, 1), (7, 1), (8, 2), (9, 2)])
def test_only_full_blocks_are_hashed(num_tokens: int, num_hashes: int) -> None:
    tokens = list(range(num_tokens))
    hashes = hash_token_blocks(NS, tokens)
    assert len(hashes) == num_hashes
    # The partial trailing block does not influence the hashes of the full ones.
    assert hashes == hash_token_blocks(NS, tokens[: num_hashes * NS.block_size])


def test_incremental_extend_equals_one_shot() -> None:
    tokens = list(range(50, 73))  # 23 tokens: 5 full blocks
    one_shot = hash_token_blocks(NS, tokens)
    assert len(one_shot) == 5

    incremental: list[bytes] = []
    for n in range(len(tokens) + 1):
        returned = extend_block_hashes(NS, tokens[:n], incremental)
        assert returned is incremental  # appends in place
        assert incremental == one_shot[: n // NS.block_size]
    assert incremental == one_shot


def test_extend_does_not_rehash_existing_prefix() -> None:
    """Existing hashes are taken as given: extend appends after them and chains onto the last one."""
    tokens = list(range(1, 13))
    sentinel = b"\x01" * HASH_SIZE_BYTES
    hashes = extend_block_hashes(NS, tokens, [sentinel])
    assert hashes[0] == sentinel
    assert hashes[1] == hash_block_tokens(sentinel, tokens[4:8])
    assert hashes[2] == hash_block_tokens(hashes[1], tokens[8:12])


def test_extend_in_big_jumps_equals_one_shot() -> None:
    tokens = list(range(1000, 1030))
    hashes: list[bytes] = []
    extend_block_hashes(NS, tokens[:6], hashes)
    assert len(hashes) == 1
    extend_block_hashes(NS, tokens[:17], hashes)
    assert len(hashes) == 4
    extend_block_hashes(NS, tokens, hashes)
    assert hashes == hash_token_blocks(NS, tokens)


def test_an_adapters_chain_starts_from_its_own_root() -> None:
    from kv_transfer.block_hash import adapter_root

    tokens = list(range(12))
    base = hash_token_blocks(NS, tokens)
    assert adapter_root(NS, None) == NS.root and hash_token_blocks(NS, tokens, root=NS.root) == base
    sql, chat = (hash_token_blocks(NS, tokens, root=adapter_root(NS, d)) for d in ("sha256:1", "sha256:2"))
    assert len({base[0], sql[0], chat[0]}) == 3 and not set(base) & set(sql)  # no block is shared
    assert hash_token_blocks(NS, tokens, root=adapter_root(NS, "sha256:1")) == sql  # deterministic
    assert extend_block_hashes(NS, tokens, sql[:1], root=adapter_root(NS, "sha256:1")) == sql  # incremental
