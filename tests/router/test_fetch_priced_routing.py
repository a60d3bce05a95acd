"""Prefix-aware routing with peer fetch on: the prefix blocks a worker lacks but could fetch from a live holder cost
their fetch (router/peer_fetch.py's price), not their compute, so a busy holder's family spreads to an idle worker
once fetching there costs less than the holder's queue (router/routing.py, `fetch_price`). Pure: exact snapshots,
the real pricer, no I/O."""

from __future__ import annotations

from kv_transfer.block_hash import BlockHashNamespace
from kv_transfer.prefix_index import HeldPrefix
from router.peer_fetch import PeerFetchRates, fetch_pricer
from router.prefix_routing import PrefixLookup
from router.routing import WorkerLoad, num_blocks_needed, plan_route

BLOCK = 16
BLOCK_BYTES = 368_640  # SmolLM2's float32 block
NS = BlockHashNamespace(model="sha256:spill", block_size=BLOCK, kv_dtype="float32")
PROMPT_TOKENS = 1_532  # a 1,500-token family prefix (93 full blocks) and a 32-token question
NUM_BLOCKS = num_blocks_needed(PROMPT_TOKENS, BLOCK)  # 96
FAMILY = 93

# With the priors (500 MB/s, 2,000 tokens/s) a block fetches in 0.74 ms and computes in 8 ms: the family's 93 blocks
# cost 93 x 0.74 / 8 = 8.6 computed blocks on p1, and p1's whole prompt 96 - 93 + 8.6 = 11.6. On p0, which holds
# the family, the prompt costs 3 blocks, and so does each request in a queue (the penalty: the least cost
# anywhere); the fetch counts as one on p1's. p0 keeps the family while 3 + 3 x queued < 11.6 + 3: up to 3 queued;
# from 4 queued p1 fetches it.


def load(worker_id: str, role: str = "prefill", *, queued: int = 0) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, endpoint=f"{worker_id}:1", healthy=True, num_waiting=queued,
                      kv_blocks_free=600, kv_blocks_total=600, kv_block_bytes=BLOCK_BYTES)


def route(loads: list[WorkerLoad], lookup: PrefixLookup, *, peer_fetch: bool = True,
          rates: PeerFetchRates | None = None, policy: str = "prefix-aware") -> str:
    """The prefill worker the gateway picks, as router/dispatcher.py asks: the pricer only with peer fetch on."""
    pricer = fetch_pricer(lookup.overlap, loads, num_prompt_tokens=PROMPT_TOKENS, block_size=BLOCK,
                          rates=rates or PeerFetchRates(), device_reach=lookup.device_reach) if peer_fetch else None
    chosen = plan_route("disaggregated", loads, num_blocks=NUM_BLOCKS, policy=policy, turn=0,
                        prefix_overlap_blocks=lookup.overlap, prefix_tier_blocks=lookup.lower_tier_blocks,
                        num_prompt_tokens=PROMPT_TOKENS, block_size=BLOCK, fetch_price=pricer)
    return chosen.prefill_worker.worker_id


def held(**tiers: HeldPrefix) -> PrefixLookup:
    return PrefixLookup(namespace=NS, block_hashes=[], overlap={w: t.num_blocks for w, t in tiers.items()},
                        held=dict(tiers))


ON_P0 = held(p0=HeldPrefix((("device", FAMILY),)))


def test_a_busy_holders_family_goes_to_the_idle_worker_once_fetching_costs_less_than_the_queue() -> None:
    d0 = load("d0", role="decode")
    assert route([load("p0", queued=4), load("p1"), d0], ON_P0) == "p1"
    assert route([load("p0", queued=30), load("p1"), d0], ON_P0) == "p1"
    # --no-kv-peer-fetch: the idle worker would compute the family (96 blocks), so it stays on p0 (3 + 3 x 30).
    assert route([load("p0", queued=30), load("p1"), d0], ON_P0, peer_fetch=False) == "p0"


def test_the_family_stays_on_its_holder_while_its_queue_costs_less_than_the_fetch() -> None:
    d0 = load("d0", role="decode")
    assert route([load("p0", queued=3), load("p1"), d0], ON_P0) == "p0"  # 3 + 9 = 12 < 11.6 + 3
    assert route([load("p0", queued=1), load("p1"), d0], ON_P0) == "p0"  # a request finished, not polled yet
    assert route([load("p0"), load("p1"), d0], ON_P0) == "p0"


def test_a_fetch_that_costs_more_than_a_recompute_prices_nothing() -> None:
    """Measured: a slow link (3.7 MB/s) and a fast prefill on p1; the fetch would lose to the recompute, so p1's
    cost is its compute, and the family stays on p0 however long its queue (within reason)."""
    rates = PeerFetchRates()
    rates.observe_fetch("p0", "p1", 10 * BLOCK_BYTES, 1.0)
    rates.observe_prefill("p1", 20_000, 1.0)
    assert route([load("p0", queued=20), load("p1"), load("d0", role="decode")], ON_P0, rates=rates) == "p0"


def test_only_blocks_a_live_holder_has_on_its_device_are_fetchable() -> None:
    """p0 keeps the family on disk: it cannot send it (a holder serves device blocks), so p1 would compute it, and
    the family stays on p0 (3 blocks + 93 x 0.25 loaded, plus its queue). A decode worker holding it on its device
    is a holder, while it is healthy."""
    on_disk = held(p0=HeldPrefix((("disk", FAMILY),)))
    assert route([load("p0", queued=1), load("p1"), load("d0", role="decode")], on_disk) == "p0"
    also_d0 = held(p0=HeldPrefix((("disk", FAMILY),)), d0=HeldPrefix((("device", FAMILY),)))
    assert route([load("p0", queued=1), load("p1"), load("d0", role="decode")], also_d0) == "p1"
    d0_down = WorkerLoad(worker_id="d0", role="decode", endpoint="d0:1", healthy=False, kv_block_bytes=BLOCK_BYTES)
    assert route([load("p0", queued=1), load("p1"), d0_down, load("d1", role="decode")], also_d0) == "p0"


def test_other_policies_route_as_before() -> None:
    """Least-loaded and round-robin do not price blocks: the fetch still saves its recompute, but routing is by load."""
    loads = [load("p0", queued=1), load("p1"), load("d0", role="decode")]
    assert route(loads, ON_P0, policy="least-loaded") == "p1"
    assert route(loads, ON_P0, policy="least-loaded", peer_fetch=False) == "p1"
    assert route([load("p0"), load("p1", queued=1), load("d0", role="decode")], ON_P0, policy="least-loaded") == "p0"
