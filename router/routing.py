"""The routing policy: pure functions from worker load snapshots (and, for `prefix-aware`, the prefix index's
overlaps) to the workers one request goes to.

No I/O, no clocks: the worker registry supplies `WorkerLoad` snapshots, the Redis prefix index supplies overlaps
(worker id -> leading blocks of this prompt it holds, and how many of those are on a tier below its device), and
these functions choose. Ties are broken by worker id, so
a choice is reproducible.

    policy          prefill (or colocated) worker                     decode worker
    prefix-aware    least cost: blocks to compute (prompt blocks      least cost: blocks it lacks (to receive or
                    minus its cached prefix) + its cached blocks      compute) + num_blocks x queued, then most
                    below the device x TIER_LOAD_COST[tier] +         free blocks: load first, the overlap breaks
                    penalty x queued, penalty = the least such cost   near-ties (decode steps are shared)
                    anywhere (a queue of requests routed as well as
                    this one); with peer fetch, the blocks another
                    worker would send it priced at fetch_s /
                    recompute_s of a computed block (`FetchPrice`)
    least-loaded    fewest queued, then most free blocks              fewest queued, then most free blocks
    round-robin     the n-th candidate by id, n = a counter the caller advances per request

Conditional disaggregation (any policy): when the part of the prompt the chosen decode worker does not hold is at
most `local_prefill_threshold_tokens`, the decode worker prefills it itself and no KV moves (`Route.prefill` None).

Room: a worker whose whole KV cache cannot hold the request's blocks is skipped; among the rest, workers with
enough free blocks right now are preferred. When none has room now, the least loaded still gets the request
and queues it: snapshots are up to one poll interval old, and refusing work the worker would admit a moment
later turns every burst into 503s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kv_transfer.layout import cdiv
from protos.worker_info import ROLES  # noqa: F401 - the one definition, re-exported for the router

POLICIES = ("prefix-aware", "least-loaded", "round-robin")

# The prefill cost of a prompt block a worker holds below its device, in computed blocks: it is loaded, not computed.
# Disk: the KV offload tier's returning-chats bench (docs/benchmarks.md, "KV offload tier") loads a block from a
# cold disk in well under a tenth of its compute on CPU; priced at 1/4 because a GPU computes a block many times
# faster than a CPU while the disk reads it no faster, so the CPU ratio flatters the disk. Host: a copy over PCIe
# into a GPU's cache, not measured yet; priced below the disk. A tier not listed is priced as computing the block.
TIER_LOAD_COST = {"host": 0.1, "disk": 0.25}


def tier_load_cost(tier: str) -> float:
    return TIER_LOAD_COST.get(tier, 1.0)


@dataclass(frozen=True, kw_only=True)
class WorkerLoad:
    """One worker's load as the router last saw it."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    endpoint: str  # "host:port"
    healthy: bool
    num_running: int = 0
    num_waiting: int = 0
    num_receiving_kv: int = 0  # a decode worker's requests whose prompt KV is on its way (theirs to decode)
    num_pending: int = 0  # requests this router sent it since the load was read (not in the counts yet)
    kv_blocks_free: int = 0  # net of the blocks the pending requests will take
    kv_blocks_total: int = 0  # 0: not reported, so room is not checked
    max_num_seqs: int = 0  # requests one engine step runs; 0: not reported
    incarnation: int = 0  # index entries of another incarnation are not this worker's
    kv_block_bytes: int = 0  # one KV block's bytes (peer fetch prices a fetch with it); 0: not reported
    lora_adapters: frozenset[tuple[str, str]] = frozenset()  # the LoRA adapters it serves, (name, digest)

    @property
    def num_queued(self) -> int:
        return self.num_running + self.num_waiting + self.num_receiving_kv + self.num_pending

    def can_ever_hold(self, num_blocks: int) -> bool:
        return self.kv_blocks_total == 0 or num_blocks <= self.kv_blocks_total

    def has_room_now(self, num_blocks: int) -> bool:
        return self.kv_blocks_total == 0 or num_blocks <= self.kv_blocks_free


@dataclass(frozen=True)
class LoRATarget:
    """The LoRA adapter a request's `model` names: only workers serving this adapter (name and digest) take it, and
    its prompt's blocks hash from the adapter's root (kv_transfer/block_hash.py)."""

    name: str
    digest: str


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where one request goes: `target` gets the Generate call; `prefill` (disaggregated only) runs the prompt."""

    target: WorkerLoad
    prefill: WorkerLoad | None = None  # None in colocated mode, and for a local prefill on the decode worker

    @property
    def prefill_worker(self) -> WorkerLoad:
        """The worker that runs the prompt: the prefill worker, or the target itself."""
        return self.prefill if self.prefill is not None else self.target


class FetchPrice(Protocol):
    """A priced peer fetch for one worker (router/peer_fetch.py's `PeerFetchPlan`): blocks [first_block,
    num_blocks) of the prompt, another worker's, moved in `fetch_s` or computed in `recompute_s`."""

    @property
    def first_block(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def fetch_s(self) -> float: ...
    @property
    def recompute_s(self) -> float: ...
    @property
    def fetch(self) -> bool: ...


# The worker that would run the prompt -> its priced fetch, None when no other worker holds more of the prompt.
FetchPricer = Callable[[WorkerLoad], "FetchPrice | None"]


def fetched_blocks_saved(plan: FetchPrice | None) -> float:
    """Computed blocks a fetch saves: the blocks it moves, less their fetch priced in computed blocks (fetch_s /
    recompute_s each). 0 when there is no fetch, or it costs more than computing them (the fetcher computes)."""
    if plan is None or not plan.fetch or plan.recompute_s <= 0:
        return 0.0
    return (plan.num_blocks - plan.first_block) * (1.0 - plan.fetch_s / plan.recompute_s)


class NoWorkerError(Exception):
    """No worker can take the request; the message says why (the HTTP layer answers 503)."""


def num_blocks_needed(num_prompt_tokens: int, block_size: int) -> int:
    """KV blocks a request needs to be admitted: its prompt plus its first generated token."""
    return cdiv(num_prompt_tokens + 1, block_size)


def pick_decode_worker(
    loads: Sequence[WorkerLoad],
    *,
    num_blocks: int,
    prefix_overlap_blocks: Mapping[str, int] | None = None,
    role: str = "decode",
) -> WorkerLoad:
    """The decode worker for a request needing `num_blocks`: without overlaps, fewest queued then most free
    blocks; with them, least (blocks it lacks + num_blocks x queued), then most free blocks."""
    overlap = prefix_overlap_blocks or {}
    candidates = _candidates(loads, role=role, num_blocks=num_blocks)

    def cost(load: WorkerLoad) -> tuple[int, int, str]:
        lacking = num_blocks - min(max(overlap.get(load.worker_id, 0), 0), num_blocks)
        return (lacking + num_blocks * load.num_queued, -load.kv_blocks_free, load.worker_id)

    return min(candidates, key=cost)


def pick_prefill_worker(
    loads: Sequence[WorkerLoad],
    *,
    num_blocks: int,
    prefix_overlap_blocks: Mapping[str, int] | None = None,
    prefix_tier_blocks: Mapping[str, Mapping[str, int]] | None = None,
    load_penalty_blocks: float | None = None,
    role: str = "prefill",
    fetch_price: FetchPricer | None = None,
) -> WorkerLoad:
    """The prefill worker with the least cost, in blocks to compute:

        cost = (num_blocks - cached prefix blocks) + sum over lower tiers of (its cached blocks there x
               TIER_LOAD_COST[tier]) - computed blocks a peer fetch saves it
               + load_penalty_blocks * (num_queued + 1 if it fetches, else num_queued)

    `prefix_overlap_blocks` (worker id -> leading blocks of this prompt it holds, on any tier) comes from the prefix
    index; without it every worker has the same compute cost and the least loaded wins. `prefix_tier_blocks`
    (worker id -> {tier below the device: how many of those leading blocks are there}) prices a hit by tier; a
    worker missing from it holds its blocks on the device, which cost nothing.
    `load_penalty_blocks` prices one queued request. By default, what this request costs where it costs least
    (at least one block): a worker's queue is taken to hold requests as well routed as this one. A request whose
    prefix is cached on a busy worker then stays there until the worker's queue costs more than computing the
    prompt elsewhere, instead of leaving it as soon as its queue is one request longer.
    `fetch_price` (peer fetch on): a worker's priced fetch of the blocks another live worker holds on its device
    beyond its own (`FetchPrice`); those blocks cost what fetching them costs, not computing them
    (`fetched_blocks_saved`), so a busy holder's family spreads to a worker that fetches it once fetching there
    costs less than the holder's queue. A fetch also counts as one more request queued on the fetcher: its round
    trip to the holder comes before the prompt's prefill and is not in the bytes over the link's rate, and a
    holder's queue one request longer than it seemed (the registry counts a request it sent until the next load
    poll, finished or not) must not move a family. The same price decides the fetch once the worker is chosen.
    """
    overlap = prefix_overlap_blocks or {}
    tier_blocks = prefix_tier_blocks or {}
    candidates = _candidates(loads, role=role, num_blocks=num_blocks)
    costs: dict[str, float] = {}
    fetching: set[str] = set()  # workers whose cost counts a fetch

    def to_compute(load: WorkerLoad) -> float:
        if load.worker_id in costs:
            return costs[load.worker_id]
        held = min(max(overlap.get(load.worker_id, 0), 0), num_blocks)
        loading, num_below = 0.0, 0
        for tier, n in tier_blocks.get(load.worker_id, {}).items():
            n = min(max(n, 0), held - num_below)  # never more below the device than held
            num_below += n
            loading += n * tier_load_cost(tier)
        saved = fetched_blocks_saved(fetch_price(load)) if fetch_price is not None else 0.0
        if saved > 0:
            fetching.add(load.worker_id)
        costs[load.worker_id] = num_blocks - held + loading - saved
        return costs[load.worker_id]

    penalty = load_penalty_blocks
    if penalty is None:
        penalty = max(1.0, min(to_compute(load) for load in candidates))

    def cost(load: WorkerLoad) -> tuple[float, int, int, str]:
        queued = load.num_queued + (load.worker_id in fetching)
        return (to_compute(load) + penalty * queued, load.num_queued, -load.kv_blocks_free, load.worker_id)

    return min(candidates, key=cost)


def pick_round_robin(loads: Sequence[WorkerLoad], *, num_blocks: int, turn: int, role: str) -> WorkerLoad:
    """The `turn`-th healthy worker of `role` that could ever hold the request, cycling in id order."""
    candidates = sorted(_candidates(loads, role=role, num_blocks=num_blocks, prefer_room=False),
                        key=lambda load: load.worker_id)
    return candidates[turn % len(candidates)]


def plan_route(
    mode: str,
    loads: Sequence[WorkerLoad],
    *,
    num_blocks: int,
    policy: str = "prefix-aware",
    prefix_overlap_blocks: Mapping[str, int] | None = None,
    prefix_tier_blocks: Mapping[str, Mapping[str, int]] | None = None,
    turn: int = 0,
    num_prompt_tokens: int | None = None,
    block_size: int = 16,
    local_prefill_threshold_tokens: int = 0,
    fetch_price: FetchPricer | None = None,
) -> Route:
    """The route for one request in `mode` ("disaggregated" | "colocated") under `policy`. NoWorkerError when
    there is none. `turn` advances round-robin; `num_prompt_tokens` (with `block_size`) decides a local prefill
    on the decode worker when at most `local_prefill_threshold_tokens` of the prompt are not cached there.
    `prefix_tier_blocks` prices the prefill (or colocated) worker's hits by tier, `fetch_price` (peer fetch on)
    the blocks it would fetch (`pick_prefill_worker`); both prefix-aware only."""
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
    overlap = prefix_overlap_blocks if policy == "prefix-aware" else None
    tiers = prefix_tier_blocks if policy == "prefix-aware" else None
    fetches = fetch_price if policy == "prefix-aware" else None

    def pick(role: str, pick_by_cost: Callable[..., WorkerLoad], **priced: object) -> WorkerLoad:
        if policy == "round-robin":
            return pick_round_robin(loads, num_blocks=num_blocks, turn=turn, role=role)
        return pick_by_cost(loads, num_blocks=num_blocks, prefix_overlap_blocks=overlap, role=role, **priced)

    if mode == "colocated":
        return Route(target=pick("colocated", pick_prefill_worker, prefix_tier_blocks=tiers, fetch_price=fetches))
    if mode != "disaggregated":
        raise ValueError(f"unknown routing mode {mode!r}")
    decode = pick("decode", pick_decode_worker)
    if num_prompt_tokens is not None and local_prefill_threshold_tokens > 0:
        cached_tokens = min((overlap or {}).get(decode.worker_id, 0) * block_size, num_prompt_tokens)
        if num_prompt_tokens - cached_tokens <= local_prefill_threshold_tokens:
            return Route(target=decode)
    return Route(target=decode, prefill=pick("prefill", pick_prefill_worker, prefix_tier_blocks=tiers,
                                             fetch_price=fetches))


def _candidates(
    loads: Sequence[WorkerLoad], *, role: str, num_blocks: int, prefer_room: bool = True
) -> list[WorkerLoad]:
    """Healthy workers of `role` that could ever hold the request; those with room now if there are any (and
    `prefer_room`)."""
    healthy = [load for load in loads if load.role == role and load.healthy]
    if not healthy:
        raise NoWorkerError(f"no healthy {role} worker")
    fitting = [load for load in healthy if load.can_ever_hold(num_blocks)]
    if not fitting:
        largest = max(load.kv_blocks_total for load in healthy)
        raise NoWorkerError(f"no {role} worker can hold {num_blocks} KV blocks (the largest holds {largest})")
    if not prefer_room:
        return fitting
    with_room = [load for load in fitting if load.has_room_now(num_blocks)]
    return with_room or fitting
