"""The engine's speculative decoding, one step at a time. No torch (a model-based proposer brings its own).

    propose      before the schedule: the policy picks k per decoding request, the proposer drafts, the drafts
                 wait on the requests (`Request.spec_token_ids`) for the scheduler to take as extra tokens
    draft        after the schedule, for a model proposer: it drafts into the KV slots the scheduler allocated
    observe      after the step: the target step's time (for the cost model) and what was accepted (metrics)

The acceptance counts per request live on the request (`Request.spec`); the totals and the distribution of the
chosen k live here, as counters since start. Without speculative decoding the engine runs a `NullSpeculator`:
the same hooks, doing nothing, and counters that stay zero, so the step has no `if speculating` branch.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus, SpecDecodeCounts
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode.cost_model import StepCostModel
from engine.spec_decode.policy import choose_dynamic, choose_fixed
from engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from engine.loader.checkpoint import Checkpoint
    from engine.model_runner import ModelRunner


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, token_budget: int) -> None:
        self.config = config
        self.proposer = proposer
        self.token_budget = token_budget
        self.cost_model = StepCostModel()
        self.num_drafts = 0  # verifications (request-steps with at least one draft)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens
        self.chosen_k: Counter[int] = Counter()  # k the policy chose, per decoding request and step
        # Every verification's outcomes, as one request's would be: a new request's acceptance estimate starts
        # from this (what this proposer achieves on this workload) rather than from a fixed prior, so a proposer
        # that is no use here is not tried again on every new request.
        self.engine_acceptance = SpecDecodeCounts()

    def propose(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        decoding = [
            r for r in running if r.status is RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1
        ]
        if not decoding:
            return
        for request in decoding:
            if request.spec.num_drafts == 0:
                request.spec.acceptance_rate = self.engine_acceptance.acceptance_rate
        num_drafts = self._choose(decoding, running, waiting)
        self.chosen_k.update(num_drafts)
        for request in decoding:
            request.spec_token_ids = []
        if not any(num_drafts):
            return
        start = time.perf_counter()
        drafts = self.proposer.propose(decoding, num_drafts)
        if not self.drafts_after_schedule:
            self.cost_model.observe_draft(sum(len(d) for d in drafts), time.perf_counter() - start)
        for request, draft in zip(decoding, drafts, strict=True):
            request.spec_token_ids = draft

    @property
    def drafts_after_schedule(self) -> bool:
        """A model proposer drafts into KV slots, so only once the scheduler has allocated them: before the
        schedule it reserves them with placeholder drafts, and `draft` fills them in."""
        return getattr(self.proposer, "drafts_after_schedule", False)

    def draft(self, scheduled: SchedulerOutput) -> None:
        """The schedule's step between schedule and execute, for a model proposer."""
        if not self.drafts_after_schedule:
            return
        items = [item for item in scheduled.scheduled if item.spec_token_ids]
        if not items:
            return
        start = time.perf_counter()
        self.proposer.draft(items)  # type: ignore[attr-defined]
        self.cost_model.observe_draft(sum(len(item.spec_token_ids) for item in items), time.perf_counter() - start)

    def _choose(self, decoding: list[Request], running: Sequence[Request], waiting: Sequence[Request]) -> list[int]:
        k = self.config.num_speculative_tokens
        if self.config.policy == "fixed":
            return choose_fixed(len(decoding), k)
        costs = self.cost_model.costs()
        if costs is None:  # nothing measured yet: the first step runs without drafts, and is measured
            return [0] * len(decoding)
        # The step's real tokens as the scheduler will see them: every running request's, then the queue's; all
        # but the decoding requests' one token each are prompt-chunk tokens.
        num_base_tokens = sum(r.num_tokens - r.num_computed_tokens for r in running)
        num_base_tokens += sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        num_base_tokens = min(num_base_tokens, self.token_budget)
        return choose_dynamic(
            [r.spec.acceptance_rate for r in decoding],
            max_num_drafts=k,
            num_base_tokens=num_base_tokens,
            num_prompt_tokens=max(num_base_tokens - len(decoding), 0),
            token_budget=self.token_budget,
            costs=costs,
        )

    def observe_step(
        self, scheduled: SchedulerOutput, sampled: Mapping[str, Sequence[int]], elapsed_s: float
    ) -> None:
        """The target step ran `scheduled` in `elapsed_s` and produced `sampled` (before the scheduler's update)."""
        num_prompt_tokens = sum(item.num_new_tokens for item in scheduled.scheduled if not _decodes(item))
        self.cost_model.observe_step(scheduled.num_batched_tokens, elapsed_s, num_prompt_tokens=num_prompt_tokens)
        for item in scheduled.scheduled:
            num_drafts = len(item.spec_token_ids)
            token_ids = sampled.get(item.request.request_id)
            if not num_drafts or token_ids is None:
                continue
            num_accepted = len(token_ids) - 1
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            self.engine_acceptance.record(num_drafts, num_accepted, smoothing=0.05)
            for pos in range(num_accepted):
                self.num_accepted_tokens_per_pos[pos] += 1

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)


class NullSpeculator:
    """The engine's speculator when speculative decoding is off: every hook does nothing (no request ever gets a
    draft token), and every counter stays zero (`Speculator`'s, as the engine's stats read them)."""

    num_drafts = 0
    num_draft_tokens = 0
    num_accepted_tokens = 0
    num_accepted_tokens_per_pos: Sequence[int] = ()
    chosen_k: Mapping[int, int] = MappingProxyType({})

    def propose(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        pass

    def draft(self, scheduled: SchedulerOutput) -> None:
        pass

    def observe_step(
        self, scheduled: SchedulerOutput, sampled: Mapping[str, Sequence[int]], elapsed_s: float
    ) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def _decodes(item: ScheduledRequest) -> bool:
    """A decode step of its request: the one token after its last output token (plus drafts), not a prompt chunk
    nor a recomputation after preemption."""
    return (item.samples and item.num_new_tokens == 1 + len(item.spec_token_ids)
            and item.request.num_output_tokens > 0)


def make_proposer(
    config: SpeculativeConfig,
    runner: ModelRunner,
    *,
    draft_checkpoint: Checkpoint | None = None,
    max_model_len: int = 0,
    attention_backend: str = "auto",
) -> Proposer:
    """The configured proposer; layer_skip drafts with part of the runner's model and KV, draft_model with
    `draft_checkpoint` and a KV cache of its own over the runner's block ids."""
    if config.method == "ngram":
        from engine.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max)
    if config.method == "layer_skip":
        from engine.spec_decode.layer_skip_proposer import LayerSkipProposer

        assert config.num_layers is not None  # validated by the config
        return LayerSkipProposer(runner.model, runner.kv_caches, num_layers=config.num_layers,
                                 block_size=runner.block_size)
    if config.method == "draft_model":
        from engine.spec_decode.draft_model_proposer import DraftModelProposer

        if draft_checkpoint is None:
            raise ValueError("draft_model needs the draft model's checkpoint")
        return DraftModelProposer(
            draft_checkpoint,
            target_vocab_size=runner.model.config.vocab_size,
            num_blocks=runner.kv_cache.shape[2],
            block_size=runner.block_size,
            max_positions=max_model_len,
            attention_backend=attention_backend,
        )
    raise ValueError(f"unknown speculative method {config.method!r}")
