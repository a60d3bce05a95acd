"""The routing policy: pure functions from worker load snapshots to the workers one request goes to.

No I/O, no clocks: the worker registry supplies `WorkerLoad` snapshots, a prefix index may supply overlap
scores, and these functions choose. Ties are broken by worker id, so a choice is reproducible.

    disaggregated:  decode worker   = fewest queued (running + waiting + pending), then most free KV blocks
                    prefill worker  = least prefill cost: blocks it would compute (prompt blocks minus the
                                      blocks its prefix cache already holds) + a load penalty per queued request
    colocated:      one "colocated" worker, by the prefill cost (it runs the prefill too)

Room: a worker whose whole KV cache cannot hold the request's blocks is skipped; among the rest, workers with
enough free blocks right now are preferred. When none has room now, the least loaded still gets the request
and queues it: snapshots are up to one poll interval old, and refusing work the worker would admit a moment
later turns every burst into 503s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, kw_only=True)
class WorkerLoad:
    """One worker's load as the router last saw it."""

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    endpoint: str  # "host:port"
    healthy: bool
    num_running: int = 0
    num_waiting: int = 0
    num_pending: int = 0  # requests this router sent it since the load was read (not in the counts yet)
    kv_blocks_free: int = 0  # net of the blocks the pending requests will take
    kv_blocks_total: int = 0  # 0: not reported, so room is not checked

    @property
    def num_queued(self) -> int:
        return self.num_running + self.num_waiting + self.num_pending

    def can_ever_hold(self, num_blocks: int) -> bool:
        return self.kv_blocks_total == 0 or num_blocks <= self.kv_blocks_total

    def has_room_now(self, num_blocks: int) -> bool:
        return self.kv_blocks_total == 0 or num_blocks <= self.kv_blocks_free


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where one request goes: `target` gets the Generate call; `prefill` (disaggregated only) runs the prompt."""

    target: WorkerLoad
    prefill: WorkerLoad | None = None


class NoWorkerError(Exception):
    """No worker can take the request; the message says why (the HTTP layer answers 503)."""


def num_blocks_needed(num_prompt_tokens: int, block_size: int) -> int:
    """KV blocks a request needs to be admitted: its prompt plus its first generated token."""
    return -(-(num_prompt_tokens + 1) // block_size)


def pick_decode_worker(loads: Sequence[WorkerLoad], *, num_blocks: int, role: str = "decode") -> WorkerLoad:
    """The decode worker for a request needing `num_blocks`: fewest queued, then most free blocks."""
    candidates = _candidates(loads, role=role, num_blocks=num_blocks)
    return min(candidates, key=lambda load: (load.num_queued, -load.kv_blocks_free, load.worker_id))


def pick_prefill_worker(
    loads: Sequence[WorkerLoad],
    *,
    num_blocks: int,
    prefix_overlap_blocks: Mapping[str, int] | None = None,
    load_penalty_blocks: int | None = None,
    role: str = "prefill",
) -> WorkerLoad:
    """The prefill worker with the least cost, in blocks:

        cost = (num_blocks - cached prefix blocks) + load_penalty_blocks * num_queued

    `prefix_overlap_blocks` (worker id -> leading blocks of this prompt its prefix cache holds) comes from the
    prefix index; without it every worker has the same compute cost and the least loaded wins.
    `load_penalty_blocks` prices one queued request; by default as much as this request (`num_blocks`).
    """
    overlap = prefix_overlap_blocks or {}
    penalty = num_blocks if load_penalty_blocks is None else load_penalty_blocks
    candidates = _candidates(loads, role=role, num_blocks=num_blocks)

    def cost(load: WorkerLoad) -> tuple[int, int, int, str]:
        to_compute = num_blocks - min(max(overlap.get(load.worker_id, 0), 0), num_blocks)
        return (to_compute + penalty * load.num_queued, load.num_queued, -load.kv_blocks_free, load.worker_id)

    return min(candidates, key=cost)


def plan_route(
    mode: str,
    loads: Sequence[WorkerLoad],
    *,
    num_blocks: int,
    prefix_overlap_blocks: Mapping[str, int] | None = None,
) -> Route:
    """The route for one request in `mode` ("disaggregated" | "colocated"). NoWorkerError when there is none."""
    if mode == "colocated":
        target = pick_prefill_worker(
            loads, num_blocks=num_blocks, prefix_overlap_blocks=prefix_overlap_blocks, role="colocated"
        )
        return Route(target=target)
    if mode != "disaggregated":
        raise ValueError(f"unknown routing mode {mode!r}")
    decode = pick_decode_worker(loads, num_blocks=num_blocks)
    prefill = pick_prefill_worker(loads, num_blocks=num_blocks, prefix_overlap_blocks=prefix_overlap_blocks)
    return Route(target=decode, prefill=prefill)


def _candidates(loads: Sequence[WorkerLoad], *, role: str, num_blocks: int) -> list[WorkerLoad]:
    """Healthy workers of `role` that could ever hold the request; those with room now if there are any."""
    healthy = [load for load in loads if load.role == role and load.healthy]
    if not healthy:
        raise NoWorkerError(f"no healthy {role} worker")
    fitting = [load for load in healthy if load.can_ever_hold(num_blocks)]
    if not fitting:
        largest = max(load.kv_blocks_total for load in healthy)
        raise NoWorkerError(f"no {role} worker can hold {num_blocks} KV blocks (the largest holds {largest})")
    with_room = [load for load in fitting if load.has_room_now(num_blocks)]
    return with_room or fitting
