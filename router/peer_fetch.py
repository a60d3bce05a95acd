"""Peer fetch, the router's half: should the worker that will run a prompt fetch the prompt's cached head from the
live worker holding most of it (worker/peer_fetch.py) rather than compute it? Priced from measurements:

    fetch_s     = blocks to move x bytes a block / the link's rate (holder -> fetcher), measured from the fetches
                  that link made (each request's first message reports its fetch's bytes and seconds); before the
                  link's first fetch, PRIOR_LINK_BYTES_S (not the holder's handoff rate: handoffs of short prompts
                  are mostly fixed cost, and would price a long head's fetch far above what it costs)
    recompute_s = those blocks' tokens / the fetcher's prefill rate, measured from its requests (computed tokens
                  over prefill seconds); before any, PRIOR_PREFILL_TOKENS_S

and fetched when fetch_s < recompute_s. Whatever the routing policy chose, the fetch only saves its recompute: the
holder is any live worker of any role holding more of the prompt than the fetcher (the prefix index's overlaps) on
its device (a holder sends device blocks only: those it keeps in a lower tier do not count), the most blocks first,
then the least queued. A holder whose blocks turn out gone refuses, and the fetcher computes them (the index can be
a poll behind).

No I/O: `PeerFetchRates` keeps the measurements (moving averages), `price_peer_fetch` decides. The prefix-aware
policy prices a candidate worker with the same function (`fetch_pricer`, router/routing.py's `FetchPricer`): the
blocks it would fetch cost their fetch, so a fetch is also the price of a spill.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from router.routing import WorkerLoad

# Before any measurement: a gRPC handoff of a long prompt between two CPU workers on one host moves ~1 GB/s
# (docs/benchmarks.md: 94 MB in 53 ms), so half that; a prefill of SmolLM2 runs ~1,000-1,600 tokens/s on this
# project's 2-core machines, a GPU's far faster, so 2,000. Each is replaced by the first measurement of its link or
# worker (a moving average from then on).
PRIOR_LINK_BYTES_S = 500e6
PRIOR_PREFILL_TOKENS_S = 2_000.0
_EWMA = 0.3  # weight of the newest measurement


@dataclass(frozen=True, kw_only=True)
class PeerFetchPlan:
    """One priced choice: fetch blocks [first_block, num_blocks) of the prompt from `holder`, or compute them."""

    holder: WorkerLoad
    fetcher_id: str
    first_block: int  # the fetcher's own leading blocks, as the index knows them
    num_blocks: int  # the holder's leading blocks of the prompt (never the prompt's last token)
    fetch_s: float
    recompute_s: float

    @property
    def fetch(self) -> bool:
        return self.fetch_s < self.recompute_s


class PeerFetchRates:
    """Moving averages of each link's fetch rate (bytes/s) and each worker's prefill rate (computed tokens/s)."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, str], float] = {}
        self._prefill: dict[str, float] = {}

    def observe_fetch(self, holder_id: str, fetcher_id: str, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            _update(self._links, (holder_id, fetcher_id), num_bytes / seconds)

    def observe_prefill(self, worker_id: str, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            _update(self._prefill, worker_id, num_tokens / seconds)

    def link_bytes_s(self, holder: WorkerLoad, fetcher_id: str) -> float:
        return self._links.get((holder.worker_id, fetcher_id), PRIOR_LINK_BYTES_S)

    def prefill_tokens_s(self, worker_id: str) -> float:
        return self._prefill.get(worker_id, PRIOR_PREFILL_TOKENS_S)


def _update(table: dict, key: object, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else (1 - _EWMA) * old + _EWMA * value


def price_peer_fetch(
    overlap: Mapping[str, int], fetcher: WorkerLoad, loads: Sequence[WorkerLoad], *, num_prompt_tokens: int,
    block_size: int, rates: PeerFetchRates, device_reach: Callable[[str, int], int] | None = None,
) -> PeerFetchPlan | None:
    """The priced fetch for `fetcher` (the worker that will run the prompt), or None when no live worker holds more
    of the prompt than it does (or no block size in bytes is known yet). `overlap` counts the fetcher's own blocks
    on any tier (it loads its tier's itself); `device_reach(worker_id, first_block)`: the end of the worker's run
    of device blocks from `first_block` (`PrefixLookup.device_reach`), what a holder can send (without it, the
    overlap)."""
    max_blocks = max((num_prompt_tokens - 1) // block_size, 0)
    own = min(max(overlap.get(fetcher.worker_id, 0), 0), max_blocks)

    def sendable(worker_id: str) -> int:
        held = device_reach(worker_id, own) if device_reach is not None else overlap.get(worker_id, 0)
        return min(held, max_blocks)

    holders = [load for load in loads
               if load.healthy and load.worker_id != fetcher.worker_id and sendable(load.worker_id) > own]
    if not holders:
        return None
    holder = min(holders, key=lambda load: (-sendable(load.worker_id), load.num_queued, load.worker_id))
    num_blocks = sendable(holder.worker_id)
    block_bytes = holder.kv_block_bytes or fetcher.kv_block_bytes
    if not block_bytes:
        return None
    num_fetched = num_blocks - own
    return PeerFetchPlan(
        holder=holder, fetcher_id=fetcher.worker_id, first_block=own, num_blocks=num_blocks,
        fetch_s=num_fetched * block_bytes / rates.link_bytes_s(holder, fetcher.worker_id),
        recompute_s=num_fetched * block_size / rates.prefill_tokens_s(fetcher.worker_id))


def fetch_pricer(
    overlap: Mapping[str, int], loads: Sequence[WorkerLoad], *, num_prompt_tokens: int, block_size: int,
    rates: PeerFetchRates, device_reach: Callable[[str, int], int] | None = None,
) -> Callable[[WorkerLoad], PeerFetchPlan | None]:
    """`price_peer_fetch` for any worker that might run the prompt, one prompt's lookup and loads bound: what
    routing prices candidates with and the dispatcher then asks of the worker it chose."""
    def price(fetcher: WorkerLoad) -> PeerFetchPlan | None:
        return price_peer_fetch(overlap, fetcher, loads, num_prompt_tokens=num_prompt_tokens, block_size=block_size,
                                rates=rates, device_reach=device_reach)
    return price
