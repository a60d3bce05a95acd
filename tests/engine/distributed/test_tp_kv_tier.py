"""The disk tier below the device KV cache at tensor_parallel_size > 1 (engine/kv_tier_blocks.py with
kv_transfer/whole_blocks.py), over the tiny model (2 KV heads: TP 2 splits them, TP 4 replicates each on
two ranks), with real rank processes.

A block goes down with every head, gathered from the ranks holding them, and comes back into every rank's cache: a
returning chat at TP 2 loads its evicted history bit for bit (an int8 cache's scales too) and answers as TP 1 does
without a tier; a tier written at one size serves a restart at another, since its entries are the model's blocks
whatever the size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kv_transfer.whole_blocks import WholeBlocks
from tests.engine.test_kv_tier import (BLOCK_SIZE, HISTORY, NEXT_TURN, NUM_COMPUTED_BLOCKS, _engine, _returning_chat,
                                       _run)
from tests.engine.tiny_model import BlockRefCounter, assert_no_blocks_held, greedy

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _whole(engine) -> WholeBlocks:  # noqa: ANN001
    blocks = engine.kv_blocks
    return WholeBlocks(blocks.layout, blocks.ranks)


def _whole_kv_of_cached(engine, hashes) -> dict[bytes, tuple]:  # noqa: ANN001
    """Each block the device prefix cache holds under one of `hashes`: every head, from every rank's cache."""
    whole = _whole(engine)
    kv = {}
    for block_hash in hashes:
        block = engine.block_pool.get_cached_block(block_hash)
        if block is not None:
            kv[block_hash] = whole.read(block.block_id)
    return kv


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_returning_turn_at_tp2_loads_every_ranks_heads_from_disk(tiny_checkpoint, tmp_path: Path,  # noqa: ANN001
                                                                   kv_cache_dtype: str) -> None:
    expected = _returning_chat(_engine(tiny_checkpoint, kv_cache_dtype=kv_cache_dtype))
    engine = _engine(tiny_checkpoint, tmp_path, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=2)
    check_returning_turn_loads_every_ranks_heads(engine, expected, "disk", int8=kv_cache_dtype == "int8")


def check_returning_turn_loads_every_ranks_heads(engine, expected, tier: str, *,  # noqa: ANN001
                                                 int8: bool = False) -> None:
    """`engine` (TP > 1, a tier) answers the returning chat as `expected`, its history loaded from `tier` bit for
    bit into every rank (an int8 cache's scales too), every block back; closes `engine`."""
    try:
        counter = BlockRefCounter(engine)
        computed = {}

        def remember_history_kv(first: list[int]) -> None:
            hashes = engine.make_request("p", HISTORY + first, greedy()).block_hashes
            computed.update(_whole_kv_of_cached(engine, hashes))

        assert _returning_chat(engine, remember_history_kv) == expected
        assert len(computed) == NUM_COMPUTED_BLOCKS
        loaded = _whole_kv_of_cached(engine, computed)
        assert loaded.keys() == computed.keys()
        for block_hash, (kv, scales) in computed.items():  # bit for bit, every head of every rank
            assert torch.equal(kv, loaded[block_hash][0])
            assert (scales is not None) == int8
            assert scales is None or torch.equal(scales, loaded[block_hash][1])
        stats = engine.stats()
        assert stats.prefix_cache_hits_by_tier[tier] == NUM_COMPUTED_BLOCKS * BLOCK_SIZE
        assert_no_blocks_held(engine)
        counter.assert_balanced()
    finally:
        engine.close()


@pytest.mark.parametrize(("written_at", "read_at"), [(2, 1), (1, 4)])
def test_a_tier_written_at_one_size_serves_a_restart_at_another(tiny_checkpoint, tmp_path: Path,  # noqa: ANN001
                                                                written_at: int, read_at: int) -> None:
    reference = _engine(tiny_checkpoint)
    first = _run(reference, "turn-1", HISTORY)
    second = _run(reference, "turn-2", HISTORY + first + NEXT_TURN)
    writer = _engine(tiny_checkpoint, tmp_path, tensor_parallel_size=written_at)
    try:
        assert _run(writer, "turn-1", HISTORY) == first
    finally:
        writer.close()  # writes its device prefix cache down
    reader = _engine(tiny_checkpoint, tmp_path, tensor_parallel_size=read_at)
    try:
        assert _run(reader, "turn-2", HISTORY + first + NEXT_TURN) == second
        assert reader.stats().prefix_cache_hits_by_tier["disk"] == NUM_COMPUTED_BLOCKS * BLOCK_SIZE
        assert_no_blocks_held(reader)
    finally:
        reader.close()


def test_a_disk_tier_at_tp2_is_taken_on_either_device() -> None:
    """On cuda too (its GPU test: tests/engine/distributed/test_tensor_parallel_cuda.py); a host-memory tier only
    there."""
    from engine.config import EngineConfig
    from engine.kv_tier_blocks import check_tier_config

    config = EngineConfig(model="/nonexistent", tensor_parallel_size=2, kv_offload_dir="/tmp/x",
                          kv_offload_size_bytes=1 << 20, num_kv_blocks=8)
    check_tier_config(config, torch.device("cpu"))
    check_tier_config(config, torch.device("cuda"))
    host = EngineConfig(model="/nonexistent", tensor_parallel_size=2, kv_offload_memory_bytes=1 << 20,
                        num_kv_blocks=8)
    check_tier_config(host, torch.device("cuda"))
    with pytest.raises(ValueError, match="on cpu the KV cache is already in host memory"):
        check_tier_config(host, torch.device("cpu"))
