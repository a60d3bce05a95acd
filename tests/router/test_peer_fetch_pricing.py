"""The router's peer fetch decision (router/peer_fetch.py), pure: which holder, which blocks, and fetch against
recompute from the measured rates."""

from __future__ import annotations

import pytest

from kv_transfer.block_hash import BlockHashNamespace
from kv_transfer.prefix_index import HeldPrefix
from router.peer_fetch import PRIOR_LINK_BYTES_S, PRIOR_PREFILL_TOKENS_S, PeerFetchRates, price_peer_fetch
from router.prefix_routing import PrefixLookup
from router.routing import WorkerLoad

BLOCK = 16
BLOCK_BYTES = 368_640  # SmolLM2's float32 block
NS = BlockHashNamespace(model="sha256:peer", block_size=BLOCK, kv_dtype="float32")


def load(worker_id: str, role: str = "prefill", **kwargs) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, endpoint=f"{worker_id}:1", healthy=True,
                      kv_block_bytes=BLOCK_BYTES, **kwargs)


def price(overlap, fetcher, loads, rates=None, num_prompt_tokens=1_000, device_reach=None):  # noqa: ANN001, ANN201
    return price_peer_fetch(overlap, fetcher, loads, num_prompt_tokens=num_prompt_tokens, block_size=BLOCK,
                            rates=rates or PeerFetchRates(), device_reach=device_reach)


def test_the_holder_with_most_blocks_then_least_queued_is_priced_against_a_recompute() -> None:
    p0, p1, d0 = load("p0"), load("p1", num_running=3), load("d0", role="decode")
    plan = price({"p1": 40, "d0": 40, "p0": 5}, p0, [p0, p1, d0])
    assert plan is not None
    assert (plan.holder.worker_id, plan.first_block, plan.num_blocks) == ("d0", 5, 40)  # d0: as many, less queued
    assert plan.fetch_s == pytest.approx(35 * BLOCK_BYTES / PRIOR_LINK_BYTES_S)
    assert plan.recompute_s == pytest.approx(35 * BLOCK / PRIOR_PREFILL_TOKENS_S)
    assert plan.fetch  # 26 ms of bytes against 280 ms of prefill


def test_never_the_prompts_last_token_nor_a_fetcher_that_holds_as_much() -> None:
    p0, p1 = load("p0"), load("p1")
    plan = price({"p1": 70}, p0, [p0, p1], num_prompt_tokens=64 * BLOCK)
    assert plan is not None and plan.num_blocks == 63  # the last block's last token is computed
    assert price({"p1": 10, "p0": 10}, p0, [p0, p1]) is None
    down = WorkerLoad(worker_id="p1", role="prefill", endpoint="p1:1", healthy=False, kv_block_bytes=BLOCK_BYTES)
    assert price({"p1": 10}, p0, [p0, down]) is None
    assert price({}, p0, [p0, p1]) is None
    unknown_size = WorkerLoad(worker_id="p1", role="prefill", endpoint="p1:1", healthy=True)
    assert price({"p1": 10}, WorkerLoad(worker_id="p0", role="prefill", endpoint="p0:1", healthy=True),
                 [unknown_size]) is None


def test_measured_rates_replace_the_priors_and_can_make_a_recompute_cheaper() -> None:
    p0, p1 = load("p0"), load("p1")
    rates = PeerFetchRates()
    rates.observe_fetch("p1", "p9", 1, 1.0)  # another link's measurement is not this one's
    assert price({"p1": 20}, p0, [p0, p1], rates).fetch_s == pytest.approx(20 * BLOCK_BYTES / PRIOR_LINK_BYTES_S)
    rates.observe_fetch("p1", "p0", 10 * BLOCK_BYTES, 1.0)  # a slow link: 3.7 MB/s
    rates.observe_prefill("p0", 20_000, 1.0)  # a fast prefill: 20k tokens/s
    plan = price({"p1": 20}, p0, [p0, p1], rates)
    assert plan.fetch_s == pytest.approx(20 * BLOCK_BYTES / (10 * BLOCK_BYTES))
    assert plan.recompute_s == pytest.approx(20 * BLOCK / 20_000)
    assert not plan.fetch
    # A moving average: one fast fetch moves the link's rate part of the way.
    rates.observe_fetch("p1", "p0", 100 * BLOCK_BYTES, 1.0)
    assert rates.link_bytes_s(p1, "p0") == pytest.approx(0.7 * 10 * BLOCK_BYTES + 0.3 * 100 * BLOCK_BYTES)
    rates.observe_fetch("p1", "p0", 0, 0.0)  # nothing moved: not a measurement
    rates.observe_prefill("p0", 0, 0.5)
    assert rates.prefill_tokens_s("p0") == 20_000


def test_a_holder_counts_only_the_blocks_on_its_device_from_the_fetchers_first_block() -> None:
    """Holders send device blocks only (worker/peer_fetch.py refuses others): blocks they keep on disk do not count.
    p1 holds 40 blocks, 0-29 on its device and 30-39 on disk; d0 holds 35, all on its device."""
    tiers = {"p1": HeldPrefix((("device", 30), ("disk", 10))), "d0": HeldPrefix((("device", 35),)),
             "p0": HeldPrefix((("disk", 5),))}
    lookup = PrefixLookup(namespace=NS, block_hashes=[], overlap={w: t.num_blocks for w, t in tiers.items()},
                          held=tiers)
    p0, p1, d0 = load("p0"), load("p1"), load("d0", role="decode")
    plan = price(lookup.overlap, p0, [p0, p1, d0], device_reach=lookup.device_reach)
    assert plan is not None  # the fetcher's own 5 disk blocks count as its own (it loads them itself)
    assert (plan.holder.worker_id, plan.first_block, plan.num_blocks) == ("d0", 5, 35)
    # Without d0, p1 sends what its device holds from block 5: blocks 5 to 29.
    plan = price(lookup.overlap, p0, [p0, p1], device_reach=lookup.device_reach)
    assert (plan.holder.worker_id, plan.first_block, plan.num_blocks) == ("p1", 5, 30)
    # A holder whose blocks from the fetcher's first one are on disk cannot send them.
    tiers = {"p1": HeldPrefix((("device", 5), ("disk", 35)))}
    lookup = PrefixLookup(namespace=NS, block_hashes=[], overlap={"p0": 5, "p1": 40}, held=tiers)
    assert price(lookup.overlap, p0, [p0, p1], device_reach=lookup.device_reach) is None
    # A worker the lookup has no tiers for holds its blocks on the device (an index written without tiers).
    lookup = PrefixLookup(namespace=NS, block_hashes=[], overlap={"p0": 5, "p1": 40})
    assert price(lookup.overlap, p0, [p0, p1], device_reach=lookup.device_reach).num_blocks == 40
