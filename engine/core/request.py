"""A request's state as the scheduler sees it. Control plane: no torch.

Lifecycle:

    WAITING ──schedule──▶ RUNNING ──stop / length / abort / error──▶ FINISHED_*
       ▲                     │
       └──── PREEMPTED ◀─────┘   (blocks freed; recomputed from its tokens when rescheduled)

Disaggregated, on the prefill worker (`remote_decode`): RUNNING ──first token──▶ PREFILLED (blocks held for the
KV handoff until the engine releases them). On the decode worker: WAITING_FOR_REMOTE_KV (blocks reserved, KV
arriving) ──commit──▶ WAITING (prompt already computed, first token appended) ──▶ RUNNING ──▶ FINISHED_*.

The one rule: each step a request catches `num_computed_tokens` up to `num_tokens` as far as the token budget
allows. A fresh prompt, a prompt chunk, a prefix-cache hit (which advances `num_computed_tokens` for free), a
recompute after preemption and a decode step are all that same rule.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.request.logprobs import TokenLogprobs
from engine.request.sampling_params import SamplingParams
from engine.request.stop_reason import StopReason
from kv_transfer.block_hash import BlockHash, BlockHashNamespace, extend_block_hashes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    PREFILLED = "prefilled"  # prefill worker: first token out, KV held for the handoff (not an OpenAI reason)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished request, None while it runs."""
        return self.value if self.finished else None


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
        RequestStatus.PREFILLED,
    }
)


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.monotonic) for the engine statistics."""

    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None


@dataclass
class SpecDecodeCounts:
    """One request's speculation so far: steps that verified drafts, drafts verified, drafts accepted (in total
    and per draft position), and the moving estimate of its per-token acceptance rate the dynamic policy reads."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    acceptance_rate: float = 0.5  # the prior until drafts are verified

    def record(self, num_draft_tokens: int, num_accepted_tokens: int, smoothing: float = 0.2) -> None:
        """Count one verification of `num_draft_tokens` drafts of which the first `num_accepted_tokens` matched.

        The estimate moves towards each observed outcome (a draft accepted: 1; the first rejected one: 0; the
        drafts after a rejection are not observed), by `smoothing` per outcome."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1
        outcomes = [1.0] * num_accepted_tokens + ([0.0] if num_accepted_tokens < num_draft_tokens else [])
        rate = self.acceptance_rate
        for outcome in outcomes:
            rate += smoothing * (outcome - rate)
        self.acceptance_rate = rate


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...],
        max_tokens: int,
        hash_namespace: BlockHashNamespace | None,
        remote_decode: bool = False,
        index: int = 0,
        bad_words_token_ids: list[tuple[int, ...]] | None = None,
        lora: object | None = None,
        hash_root: BlockHash | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index  # which choice of its client request (n > 1: engine/core/fork.py); 0 otherwise
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens  # resolved against max_model_len by the engine
        # sampling_params.bad_words as token sequences (engine/request/bad_words.py), tokenized once at admission.
        self.bad_words_token_ids: list[tuple[int, ...]] = bad_words_token_ids or []
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Its blocks already hold the KV of its computed tokens while it waits (a decode worker's committed remote
        # prompt): admitted without a prefix lookup. Cleared when it is admitted or preempted.
        self.kv_in_place = False
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache on first scheduling
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: StopReason = None  # the stop token id or stop string that ended it
        # Prefill worker: after the first token, hand the KV off instead of decoding (blocks held, not freed).
        self.remote_decode = remote_decode
        self.times = RequestTimes()
        # Speculative decoding. `spec_token_ids`: draft tokens proposed for the next step, not yet part of the
        # request's tokens (the scheduler may schedule fewer; the step's update clears them). The counts feed
        # the metrics and the dynamic policy's acceptance estimate.
        self.spec_token_ids: list[int] = []
        self.spec = SpecDecodeCounts()
        # n > 1: the other choices, forked off this one once its prompt is computed (engine/core/fork.py).
        self.pending_forks: list[Request] = []
        # sampling_params.prompt_logprobs: one per prompt token after the first, filled as the prompt computes.
        self.prompt_logprobs: list[TokenLogprobs] = []
        # The LoRA adapter it runs under (engine/lora/adapter.py's LoRAAdapter, opaque here; its name is `lora.name`),
        # or None; its blocks then chain from the adapter's own `hash_root` (kv_transfer/block_hash.py).
        self.lora = lora
        self._hash_namespace = hash_namespace
        self._hash_root = hash_root
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first `num_output_tokens` (a stop string ended the request inside a
        step that produced several tokens). Block hashes of blocks no longer full go too."""
        num_dropped = self.num_output_tokens - num_output_tokens
        if num_dropped <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - num_dropped :]
        if self._hash_namespace is not None:
            del self.block_hashes[self.num_tokens // self._hash_namespace.block_size :]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def _update_block_hashes(self) -> None:
        if self._hash_namespace is not None:
            extend_block_hashes(self._hash_namespace, self.all_token_ids, self.block_hashes, root=self._hash_root)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
