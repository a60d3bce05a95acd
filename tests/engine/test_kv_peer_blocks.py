"""Peer fetch, engine level over the tiny model: the holder pins cached blocks while a peer reads them, the fetcher
stages what arrived and its next admission loads it as prefix hits of tier "peer", with the tokens a recompute
gives. Every block goes back to the pool on both engines."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv_peer_blocks import PeerBlocks, TierChain
from tests.engine.tiny_model import assert_no_blocks_held, drain, finals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

BLOCK_SIZE = 4
PROMPT = random.Random(3).choices(range(3, 600), k=42)  # 10 full blocks, and 2 tokens
NUM_FULL = len(PROMPT) // BLOCK_SIZE


def _engine(checkpoint, **overrides):  # noqa: ANN001, ANN202
    return make_engine(checkpoint, num_kv_blocks=32, block_size=BLOCK_SIZE, **overrides)


def _run(engine, request_id: str, prompt: list[int]) -> list[int]:  # noqa: ANN001
    engine.add_request(request_id, prompt, greedy(max_tokens=5))
    return finals(drain(engine))[request_id].token_ids


def _fetch(holder, fetcher, hashes, first: int = 0) -> None:  # noqa: ANN001
    """What worker/peer_fetch.py does around the transport: pin on the holder, copy blocks [first, n) into a
    staging buffer shaped as the fetcher's cache, stage them, unpin."""
    ids = holder.pin_cached_blocks("fetch-1", hashes[first:])
    assert ids is not None
    cache = holder.runner.kv_cache
    staging = cache[:, :, ids].clone()
    scales = None if holder.runner.kv_scales is None else holder.runner.kv_scales[:, :, ids].clone()
    fetcher.stage_peer_blocks(hashes[first:], staging, scales)
    assert holder.unpin_blocks("fetch-1")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_staged_peer_blocks_are_loaded_as_prefix_hits_with_the_tokens_of_a_recompute(tiny_checkpoint,
                                                                                    kv_cache_dtype) -> None:
    holder = _engine(tiny_checkpoint, kv_cache_dtype=kv_cache_dtype)
    fetcher = _engine(tiny_checkpoint, kv_cache_dtype=kv_cache_dtype)
    expected = _run(holder, "r", PROMPT)
    hashes = fetcher.make_request("probe", PROMPT, greedy()).block_hashes[:NUM_FULL]
    assert holder.num_leading_blocks_held(hashes) == NUM_FULL and fetcher.num_leading_blocks_held(hashes) == 0
    _fetch(holder, fetcher, hashes)
    assert fetcher.num_leading_blocks_held(hashes) == NUM_FULL
    assert _run(fetcher, "r", PROMPT) == expected
    stats = fetcher.stats()
    assert stats.prefix_cache_hits_by_tier["peer"] == NUM_FULL * BLOCK_SIZE
    assert stats.prefix_cache_hits_by_tier["device"] == 0
    fetcher.unstage_peer_blocks(hashes)
    assert len(fetcher.peer_blocks) == 0
    assert fetcher.num_leading_blocks_held(hashes) == NUM_FULL  # now in its own device prefix cache
    assert_no_blocks_held(holder)
    assert_no_blocks_held(fetcher)


def test_a_fetch_of_the_tail_the_fetcher_lacks_joins_its_own_head(tiny_checkpoint) -> None:
    holder, fetcher = _engine(tiny_checkpoint), _engine(tiny_checkpoint)
    expected = _run(holder, "r", PROMPT)
    _run(fetcher, "head", PROMPT[:4 * BLOCK_SIZE + 1])  # its own first 4 blocks
    hashes = fetcher.make_request("probe", PROMPT, greedy()).block_hashes[:NUM_FULL]
    first = fetcher.num_leading_blocks_held(hashes)
    assert first == 4
    _fetch(holder, fetcher, hashes, first)
    assert _run(fetcher, "r", PROMPT) == expected
    hits = fetcher.stats().prefix_cache_hits_by_tier
    assert (hits["device"], hits["peer"]) == (first * BLOCK_SIZE, (NUM_FULL - first) * BLOCK_SIZE)


def test_pinned_blocks_survive_an_allocation_that_evicts_everything_else(tiny_checkpoint) -> None:
    holder = _engine(tiny_checkpoint)
    _run(holder, "r", PROMPT)
    hashes = holder.make_request("probe", PROMPT, greedy()).block_hashes[:NUM_FULL]
    ids = holder.pin_cached_blocks("p", hashes)
    assert ids is not None and holder.block_pool.num_used_blocks == NUM_FULL
    with pytest.raises(ValueError, match="pinned under 'p' already"):
        holder.pin_cached_blocks("p", hashes)
    other = random.Random(9).choices(range(3, 600), k=(32 - NUM_FULL) * BLOCK_SIZE - 5)
    _run(holder, "other", other)  # with its 5 tokens, every unpinned block: without the pin it evicts some
    assert all(holder.block_pool.get_cached_block(h) is not None for h in hashes)
    assert holder.unpin_blocks("p") and not holder.unpin_blocks("p")
    assert_no_blocks_held(holder)
    # A prefix the holder lacks any block of pins nothing.
    assert holder.pin_cached_blocks("q", [*hashes[:2], b"\0" * 16]) is None
    assert holder.block_pool.num_used_blocks == 0


def test_peer_blocks_count_references_and_the_chain_counts_loads_by_tier() -> None:
    cache = torch.zeros(2, 2, 4, 4, 1, 2)
    peer = PeerBlocks(cache, None)
    staged = torch.arange(2 * 2 * 2 * 4 * 1 * 2, dtype=torch.float32).view(2, 2, 2, 4, 1, 2)
    peer.stage([b"a" * 16, b"b" * 16], staged, None)
    peer.stage([b"a" * 16], staged[:, :, 1:], None)  # staged again by a second fetch: the first copy stays
    with pytest.raises(ValueError, match="1 hashes for 2 staged blocks"):
        peer.stage([b"c" * 16], staged, None)
    chain = TierChain([peer])
    assert chain.load(3, b"a" * 16) and torch.equal(cache[:, :, 3], staged[:, :, 0])
    assert not chain.load(2, b"z" * 16)
    assert chain.blocks_loaded == {"peer": 1}
    peer.unstage([b"a" * 16, b"b" * 16])
    assert b"a" * 16 in peer and b"b" * 16 not in peer
    peer.unstage([b"a" * 16])
    assert len(peer) == 0


def test_copies_fetched_from_a_peer_are_evicted_before_the_workers_own_blocks(tiny_checkpoint) -> None:
    """The peer still holds what was fetched from it: once freed, the copies go to the front of the free list, so
    the fetcher's cache keeps the prefixes only it holds (and the cluster more distinct ones)."""
    holder, fetcher = _engine(tiny_checkpoint), _engine(tiny_checkpoint)
    _run(holder, "r", PROMPT)
    own = random.Random(4).choices(range(3, 600), k=17)
    _run(fetcher, "own", own)  # computed here: its 4 full blocks are the fetcher's own
    hashes = fetcher.make_request("probe", PROMPT, greedy()).block_hashes[:NUM_FULL]
    _fetch(holder, fetcher, hashes)
    _run(fetcher, "r", PROMPT)
    fetched = {fetcher.block_pool.get_cached_block(h).block_id for h in hashes}
    own_ids = {fetcher.block_pool.get_cached_block(h).block_id
               for h in fetcher.make_request("probe", own, greedy()).block_hashes}
    free = fetcher.block_pool.free_block_ids()
    assert set(free[:NUM_FULL]) == fetched  # first to go
    assert all(free.index(b) > NUM_FULL for b in own_ids)
    # A block reused for something else is an ordinary block again.
    taken = fetcher.block_pool.allocate(1)
    assert not taken[0].evict_first
    fetcher.block_pool.free(taken)
