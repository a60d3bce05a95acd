"""Iteration-level continuous batching. Control plane: no torch.

Each `schedule()` builds one step: running requests first (in arrival order), then waiting ones, every request
catching its computed-token count up to its token count within the per-step token budget. There is no prefill or
decode phase: a fresh prompt, a prompt chunk, a prefix hit, a recompute and a decode token are the same rule.

When the pool runs dry, the most recently admitted running request is preempted (recompute preemption): its blocks
go back and it returns to the front of the waiting queue with its tokens intact. `max_loras` (LoRA adapters): a
waiting request that would make one adapter more run than that is passed over, keeping its place, as vLLM does.

A tier below the device cache (engine/core/kv_tier.py) adds loadable blocks to a prefix hit: at admission they
are allocated like new blocks, loaded from the tier by the KV cache manager and counted computed, using none of
the token budget; a block that fails its check ends the run, and the step computes from there.

Disaggregation adds two side doors, both outside the step loop:
- `hold`: a prefill worker's `remote_decode` request that produced its first token (and did not stop) leaves the
  queues but keeps its blocks, now owned by the KV handoff, until `release_held`.
- `reserve_remote` → `commit_remote`: a decode worker allocates blocks for a prompt whose KV another worker computes,
  and for the first token it will decode (prompt + 1 slots: what the request needs to start, as the router
  counts); once the KV has arrived the request joins the waiting queue with the prompt already computed
  (`kv_in_place`), so the one rule schedules it straight into decode, with no new block. The prompt's longest
  prefix already cached here is shared, not reserved: those blocks need not travel.

Progress, always: a full pool can never leave requests holding blocks while no step runs.
- Running requests that need blocks preempt the newest running request, as above.
- A waiting request with its KV in place is preemptable like any other: when nothing is running and the head of
  the waiting queue cannot get its blocks, the requests behind it that hold blocks give them up (newest first;
  each recomputes later, here), until the head fits. Arrival order is kept.
- While the head of the waiting queue is blocked on blocks, `reserve_remote` refuses: new remote prompts cannot take
  the blocks that would free up for it.
The blocks then still held are a reservation's, whose handoff commits (and so joins the queue) or is aborted.

Priority (`policy="priority"`, vLLM's --scheduling-policy priority): every queue is kept in the order of each
request's `(priority, arrival)`, lower first: the waiting queue, where a preempted request goes back to its place
by that order, and the running list, whose last request is then the one a shortage preempts. The running requests
that the head of the waiting queue outranks (a strictly lower priority value) are scheduled after its admission,
so that their prompt chunks do not take the token budget first. And a waiting request that cannot start (the batch
is full, or its blocks are not there) and outranks the last running request takes its place: that request is
preempted (unscheduled from the step, had the step scheduled it) and the head admitted in the same step; nothing
preempted in a step is admitted again in it. "fcfs" (the default) is arrival order, and a request's priority must
be 0 (engine/input_processor.py refuses another).

Async scheduling (engine/core/overlap.py): `schedule(in_flight=...)` builds the step after one whose output is not
in yet, as if that step had run; `can_schedule_ahead` says when that is safe. Outputs then come in step order, each
step's `update_from_output` after the one before it.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from engine.core.adapter_slots import adapters_of, first_admissible, one_adapter_too_many
from engine.core.fork import num_shared_blocks
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.overlap import finishes_with_in_flight_token, needs_host_tokens
from engine.core.request import Request, RequestStatus
from engine.request.sampling_params import SCHEDULING_POLICIES


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"  # or "priority": see the module docstring
    max_loras: int | None = None  # the most LoRA adapters running at once; None: any

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of `request.all_token_ids` followed
    by `spec_token_ids`, draft tokens to verify (they count in `num_new_tokens`):

        all_token_ids  [ ... computed ... | t ]  spec  [ d0 d1 d2 ]      num_new_tokens = 1 + 3
        logits at                           t            d0 d1 d2  ->  up to 4 tokens: accepted drafts + one more

    A request that samples gets logits at its last `1 + len(spec_token_ids)` positions; the runtime returns the
    accepted drafts and the token sampled after them (`num_sample_positions` tokens at most, one at least).
    """

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_new_tokens: int  # real tokens + draft tokens
    block_ids: list[int]  # the whole block table after allocation
    samples: bool  # the step reaches the end of the request's tokens: its last logits yield a new token
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify; only with samples
    # Async scheduling: its one new token is the one the step in flight samples for it (not in all_token_ids yet):
    # the runner takes it from that step's output on the device.
    takes_last_sample: bool = False

    @property
    def num_sample_positions(self) -> int:
        """How many of its last positions need logits: 0, or 1 + the number of drafts."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    _tokens_by_request: dict[str, tuple[int, bool]] | None = field(default=None, repr=False, compare=False)

    def tokens_by_request(self) -> dict[str, tuple[int, bool]]:
        """Per request: (its tokens in this step, whether the step samples for it); computed once, when the step
        is complete (async scheduling reads it while the step is in flight)."""
        if self._tokens_by_request is None:
            self._tokens_by_request = {item.request.request_id: (item.num_new_tokens, item.samples)
                                       for item in self.scheduled}
        return self._tokens_by_request

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefilled, blocks held for the KV handoff
        self.num_preemptions = 0
        self.head_blocked = False  # the last schedule could not get blocks for the head of the waiting queue
        self.by_priority = config.policy == "priority"

    # -- lifecycle -------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, error): unqueue it and free its blocks. Idempotent.

        A held (prefilled) request's blocks are freed too: an abort during the handoff ends it."""
        request = self.requests.pop(request_id, None)
        if request is None:
            request = self.held.pop(request_id, None)
            if request is None:
                return None
            request.status = status
            self.kv_cache.free(request)
            return request
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.times.finished_s = time.monotonic()
        self.kv_cache.free(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Anything a step could run (requests waiting for remote KV are not)."""
        return bool(self.waiting or self.running)

    # -- disaggregation --------------------------------------------------------------------------------------
    def release_held(self, request_id: str) -> bool:
        """Free a prefilled request's blocks once its KV handoff is over (confirmed or failed). Idempotent."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv_cache.free(request)
        return True

    def reserve_remote(self, request: Request, *, preempt: bool = False,
                       before_preempting: Callable[[], object] | None = None) -> bool:
        """Allocate blocks for `request`'s prompt, whose KV will arrive from a prefill worker, and for the first token
        it decodes. The prompt's longest cached prefix here is taken as it is (shared, nothing to receive), and the
        blocks after it that the tier below holds are loaded: `kv_cache.num_cached_blocks` says how many leading
        blocks that is. False (and nothing changed) if the pool cannot hold it now, or a waiting request is blocked
        on blocks (it goes first, unless `request` outranks it).

        `preempt` (priority policy): when the running requests `request` outranks hold enough blocks to make room,
        they give them up, lowest first, after `before_preempting()` (the engine reads a step in flight first: it
        may still write the victims' KV into those blocks)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        head = first_admissible(self.waiting, self.running, self.config.max_loras) if self.head_blocked else None
        if head is not None and not self._outranks(request, head):
            return False
        hits = self.kv_cache.cached_prefix(request)
        num_hit_tokens = len(hits) * self.kv_cache.block_size
        num_loadable = self.kv_cache.num_loadable_blocks(request, len(hits))
        num_new = request.num_prompt_tokens + 1 - num_hit_tokens
        if not self.kv_cache.allocate_slots(request, num_new, hits):
            if not (preempt and self._preemption_makes_room(request, num_new, hits)):
                return False
            if before_preempting is not None:
                before_preempting()
            while not self.kv_cache.allocate_slots(request, num_new, hits):
                if not self._outranks_last_running(request):  # the count was short: the rest keep their blocks
                    return False
                self._preempt(self.running[-1])
        if num_loadable:  # a lookup that hit the tier: counted as one (its hits are, by tier)
            self.kv_cache.prefix_queries_tokens += request.num_tokens
            self.kv_cache.load_blocks(request, len(hits), num_loadable)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return True

    def commit_remote(self, request: Request, first_token_id: int) -> RequestStatus | None:
        """The prompt's KV has arrived: mark it computed, append the first token (sampled by the prefill worker) and
        queue the request for decode. Returns a finish status if that token already ends it."""
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request.request_id!r} is not waiting for remote KV ({request.status.name})")
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv_cache.cache_blocks(request)
        request.append_output_token(first_token_id)
        request.status = RequestStatus.WAITING
        request.kv_in_place = True
        for queued in (request, *self._fork(request)):
            self._enqueue(queued)
        status = self._token_stop_status(request, first_token_id)
        if status is not None:
            self.finish_request(request.request_id, status)
        return status

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_receiving_kv(self) -> int:
        """Requests with blocks reserved for a KV handoff still on its way (a decode worker's): in neither queue."""
        return sum(1 for r in self.requests.values() if r.status is RequestStatus.WAITING_FOR_REMOTE_KV)

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed, over the waiting and running requests (a waiting prompt, the rest of a
        chunked prefill, a preempted request's prompt): the prefill work queued here, an autoscaling signal."""
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in (*self.waiting, *self.running))

    # -- one step --------------------------------------------------------------------------------------------
    def schedule(self, in_flight: SchedulerOutput | None = None) -> SchedulerOutput:
        """The next step. `in_flight`: the step launched before it whose output is not in yet (async scheduling;
        only when `can_schedule_ahead(in_flight)`): its tokens count as computed and each request it samples for
        has one more token, a placeholder this step takes from the device; a request that step surely ends sits
        this one out. Nothing is preempted then."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        ahead = {} if in_flight is None else in_flight.tokens_by_request()
        # Priority: the running requests the head of the waiting queue outranks come after its admission, so that
        # their prompt chunks cannot take the budget it needs (with fcfs, or no such head, all come first).
        split = len(self.running)
        head = first_admissible(self.waiting, self.running, self.config.max_loras) if self.by_priority else None
        if head is not None:
            split = bisect.bisect_right(self.running, head.sampling_params.priority,
                                        key=lambda r: r.sampling_params.priority)
        first, then = self.running[:split], self.running[split:]
        budget = self._schedule_running(out, first, budget, ahead, in_flight)
        if not out.preempted:
            budget = self._admit_waiting(out, budget, may_preempt=in_flight is None)
        budget = self._schedule_running(out, then, budget, ahead, in_flight)
        self._schedule_drafts(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, requests: list[Request], budget: int,
                          ahead: dict[str, tuple[int, bool]], in_flight: SchedulerOutput | None) -> int:
        """Each of `requests` (running, in order) its next tokens within `budget`; returns the budget left. Without
        a step in flight, one that cannot get its blocks preempts the last running request (itself, at worst)."""
        for request in requests:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_in_flight, placeholder = ahead.get(request.request_id, (0, False))
            if placeholder and finishes_with_in_flight_token(request, self.config.max_model_len):
                continue
            start = request.num_computed_tokens + num_in_flight
            num_new = min(request.num_tokens + placeholder - start, budget)
            if num_new <= 0:
                continue
            if in_flight is not None:
                if not self.kv_cache.allocate_slots(request, num_in_flight + num_new):
                    break  # can_schedule_ahead counted these blocks; only a request admitted before it takes them
                out.scheduled.append(self._scheduled(request, num_new, start=start, placeholder=placeholder))
                budget -= num_new
                continue
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def can_schedule_ahead(self, in_flight: SchedulerOutput) -> bool:
        """Whether the step after `in_flight` can be scheduled before its output is in (engine/core/overlap.py):
        no request it samples for and that goes on needs that token on the host, and every running request's next
        tokens fit in the free blocks (so `schedule(in_flight=...)` preempts nothing; counted without the token
        budget's cap, so never too few)."""
        if self.priority_preemption_due():
            return False
        ahead = in_flight.tokens_by_request()
        num_blocks = 0
        for request in self.running:
            num_in_flight, placeholder = ahead.get(request.request_id, (0, False))
            if placeholder:
                if finishes_with_in_flight_token(request, self.config.max_model_len):
                    continue
                if needs_host_tokens(request):
                    return False
            num_tokens = max(request.num_tokens + placeholder, request.num_computed_tokens + num_in_flight)
            num_blocks += self.kv_cache.num_blocks_needed(request.request_id, num_tokens)
        return num_blocks <= self.kv_cache.pool.num_free_blocks

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Draft tokens ride on decoding requests as extra tokens, with the budget left after every real token:
        drafts never delay a prompt or preempt a request. Each is cut to what its request can still produce."""
        for item in out.scheduled:
            request = item.request
            drafts = request.spec_token_ids
            if budget <= 0:
                break
            if not drafts or not item.samples or item.num_new_tokens != 1:
                continue
            # Every verified draft may become an output token, and the token sampled after them one more.
            room = min(
                request.max_tokens - request.num_output_tokens, self.config.max_model_len - request.num_tokens
            ) - 1
            num_drafts = min(len(drafts), budget, room)
            if num_drafts <= 0 or not self.kv_cache.allocate_slots(request, 1 + num_drafts):
                continue
            item.spec_token_ids = list(drafts[:num_drafts])
            item.num_new_tokens += num_drafts
            item.block_ids = self.kv_cache.block_ids(request.request_id)
            budget -= num_drafts

    def _admit_waiting(self, out: SchedulerOutput, budget: int, *, may_preempt: bool = True) -> int:
        """Admit from the head of the waiting queue; returns the budget left. `may_preempt` (priority policy): a
        head that outranks the last running request may take its place (not while a step is in flight)."""
        self.head_blocked = False
        passed_over: list[Request] = []  # under one adapter too many (max_loras): back in their places after
        adapters = adapters_of(self.running)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.request_id in out.preempted:  # it gave its place up in this very step
                break
            if one_adapter_too_many(adapters, request, self.config.max_loras):
                passed_over.append(self.waiting.popleft())
                continue
            if len(self.running) >= self.config.max_num_seqs:
                if not (may_preempt and self._outranks_last_running(request)):
                    break
                budget = self._preempt_scheduled(out, budget)
                continue
            num_loadable = 0
            if request.kv_in_place:  # its prompt KV came from a prefill worker: blocks in place, no lookup
                hits, num_hit_tokens = [], request.num_computed_tokens
            else:
                hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
                num_loadable = self.kv_cache.num_loadable_blocks(request, len(hits))
            # Loadable blocks (in a tier below the device cache) take new blocks but none of the token budget.
            num_loadable_tokens = num_loadable * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_hit_tokens - num_loadable_tokens, budget)
            if not self._allocate_for_head(request, num_loadable_tokens + num_new, hits):
                if may_preempt and self._outranks_last_running(request):
                    budget = self._preempt_scheduled(out, budget)
                    continue
                self.head_blocked = True
                break
            self.waiting.popleft()
            if num_loadable:
                num_loaded = self.kv_cache.load_blocks(request, len(hits), num_loadable)
                num_hit_tokens += num_loaded * self.kv_cache.block_size
                if num_loaded < num_loadable:  # a copy failed its check: the step computes from there (its
                    # blocks are allocated already, up to at least where it now ends)
                    num_new = min(request.num_tokens - num_hit_tokens, budget)
            request.num_computed_tokens = num_hit_tokens
            if request.times.first_scheduled_s is None:
                request.times.first_scheduled_s = time.monotonic()
                if not request.kv_in_place:
                    request.num_cached_tokens = num_hit_tokens
            request.kv_in_place = False
            request.status = RequestStatus.RUNNING
            if self.by_priority:
                bisect.insort_right(self.running, request, key=_rank)
            else:
                self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            adapters |= adapters_of([request])
        self.waiting.extendleft(reversed(passed_over))
        return budget

    def _outranks(self, request: Request, other: Request) -> bool:
        """Priority policy: whether `request` has a strictly lower priority value than `other`."""
        return self.by_priority and request.sampling_params.priority < other.sampling_params.priority

    def _outranks_last_running(self, request: Request) -> bool:
        """Whether `request` outranks the last running request (the lowest ranked), which it may then displace."""
        return bool(self.running) and self._outranks(request, self.running[-1])

    def _preemption_makes_room(self, request: Request, num_new_tokens: int, hits: list) -> bool:
        """Whether the free blocks and those only the running requests `request` outranks hold (a shared block
        stays) make room for `num_new_tokens` after `hits`."""
        size = self.kv_cache.block_size
        num_needed = -(-(len(hits) * size + num_new_tokens) // size) - len(hits)
        num_needed += sum(1 for block in hits if block.ref_cnt == 0)  # cached, free: a hit takes it off the list
        freeable = sum(1 for victim in self.running if self._outranks(request, victim)
                       for block_id in self.kv_cache.block_ids(victim.request_id)
                       if self.kv_cache.pool.blocks[block_id].ref_cnt == 1)
        return self.kv_cache.pool.num_free_blocks + freeable >= num_needed

    def _preempt_scheduled(self, out: SchedulerOutput, budget: int) -> int:
        """Preempt the last running request for a higher-priority head; if this step scheduled it, unschedule it
        and give its tokens back to the budget. Returns the budget."""
        victim = self.running[-1]
        for i, item in enumerate(out.scheduled):
            if item.request is victim:
                budget += item.num_new_tokens
                del out.scheduled[i]
                break
        self._preempt(victim)
        out.preempted.append(victim.request_id)
        return budget

    def priority_preemption_due(self) -> bool:
        """Whether the next synchronous schedule would preempt for the head of the waiting queue (priority
        policy): it outranks the last running request and cannot start, the batch being full or its blocks not
        there last time."""
        head = first_admissible(self.waiting, self.running, self.config.max_loras)
        return head is not None and self._outranks_last_running(head) and (
            len(self.running) >= self.config.max_num_seqs or self.head_blocked)

    def _allocate_for_head(self, request: Request, num_new: int, hits: list) -> bool:
        """Blocks for the head of the waiting queue. When nothing runs (nothing will finish and free blocks), the
        waiting requests behind it that hold blocks give them up, newest first, until it fits."""
        while not self.kv_cache.allocate_slots(request, num_new, hits):
            if self.running:
                return False
            holders = [r for r in self.waiting if r is not request and r.kv_in_place]
            if not holders:
                return False
            self._release_for_recompute(holders[-1])  # its blocks go; it keeps its place in the queue
        return True

    def _scheduled(self, request: Request, num_new: int, *, start: int | None = None,
                   placeholder: bool = False) -> ScheduledRequest:
        start = request.num_computed_tokens if start is None else start
        return ScheduledRequest(request=request, start=start, num_new_tokens=num_new, takes_last_sample=placeholder,
                                block_ids=self.kv_cache.block_ids(request.request_id),
                                samples=start + num_new == request.num_tokens + placeholder)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_for_recompute(request)
        self._enqueue(request, front=True)

    def _enqueue(self, request: Request, *, front: bool = False) -> None:
        """Into the waiting queue: at the back (`front`: the front, a preempted or forked request), or with the
        priority policy at its place by `(priority, arrival)` (`front`: before the requests of the same rank)."""
        if not self.by_priority:
            if front:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            return
        place = bisect.bisect_left if front else bisect.bisect_right
        self.waiting.insert(place(self.waiting, _rank(request), key=_rank), request)

    def _release_for_recompute(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.kv_in_place = False
        request.num_preemptions += 1
        self.num_preemptions += 1

    # -- after the step --------------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
                           ) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled tokens, apply token-level stops (EOS, stop token ids,
        max_tokens, max_model_len), cache newly full blocks and free finished requests.

        `sampled[request_id]` is, for each request that samples, its accepted draft tokens followed by the token
        sampled after them (one token without drafts). Rejected drafts are rolled back: they do not count as
        computed, and blocks that only they used go back to the pool. A token-level stop drops the tokens after it.

        Returns (request, new token id) for every token produced this step, in order; stop strings are the
        caller's to check (they need text), through `finish_request` and `Request.truncate_output`.
        """
        produced: list[tuple[Request, int]] = []
        for item in out.scheduled:
            request = item.request
            request.spec_token_ids = []
            if request.is_finished or request.status is not RequestStatus.RUNNING:
                continue
            if not item.samples:
                request.num_computed_tokens += item.num_new_tokens
                self.kv_cache.cache_blocks(request)
                continue
            token_ids = sampled[request.request_id]
            num_drafts = len(item.spec_token_ids)
            num_accepted = len(token_ids) - 1
            accepted = list(token_ids[:num_accepted])
            if not 0 <= num_accepted <= num_drafts or accepted != item.spec_token_ids[:num_accepted]:
                raise ValueError(
                    f"request {request.request_id!r}: {list(token_ids)} does not follow its drafts "
                    f"{item.spec_token_ids}"
                )
            request.num_computed_tokens += item.num_new_tokens - (num_drafts - num_accepted)
            if num_drafts:
                request.spec.record(num_drafts, num_accepted)
                if num_accepted < num_drafts:
                    self.kv_cache.free_uncomputed_tail(request)
            status = None
            for token_id in token_ids:
                request.append_output_token(token_id)
                produced.append((request, token_id))
                status = self._token_stop_status(request, token_id)
                if status is not None:  # the tokens after a stop are dropped; their KV is never used
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                    break
            self.kv_cache.cache_blocks(request)
            if request.pending_forks:  # its prompt is computed: the other choices start, ahead of the queue
                for child in reversed(self._fork(request)):
                    self._enqueue(child, front=True)
            if status is not None:
                self.finish_request(request.request_id, status)
            elif request.remote_decode:
                self._hold(request)
        return produced

    def _fork(self, parent: Request) -> list[Request]:
        """The parent's pending choices, each sharing its full prompt blocks (engine/core/fork.py), ready to
        queue: their blocks in place, the rest of the prompt to compute."""
        children, parent.pending_forks = parent.pending_forks, []
        num_blocks = num_shared_blocks(parent.num_prompt_tokens, self.kv_cache.block_size)
        for child in children:
            if child.request_id in self.requests:
                raise ValueError(f"request id {child.request_id!r} is already in use")
            self.kv_cache.fork(parent, child, num_blocks)
            child.num_computed_tokens = num_blocks * self.kv_cache.block_size
            child.kv_in_place = True
            child.status = RequestStatus.WAITING
            self.requests[child.request_id] = child
        return children

    def _hold(self, request: Request) -> None:
        # Out of the queues, blocks kept: the KV handoff owns them until release_held.
        self.requests.pop(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREFILLED
        request.times.finished_s = time.monotonic()
        self.held[request.request_id] = request

    def _token_stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        # vLLM's order: the length cap first, then EOS and stop token ids (held off until min_tokens).
        params = request.sampling_params
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)


def _rank(request: Request) -> tuple[int, float]:
    """Where a request stands under the priority policy: lower first."""
    return request.sampling_params.priority, request.times.arrival_s
