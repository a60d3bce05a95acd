"""Engine statistics, named after vLLM's metrics so a later exporter maps them one to one. No torch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.kv_tier import TierStats
from engine.core.request import Request


@dataclass(frozen=True, kw_only=True)
class RequestStats:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    queue_time_s: float  # arrival -> first scheduled
    ttft_s: float  # arrival -> first output token
    tpot_s: float  # mean time per output token after the first (0 with one token)
    e2e_latency_s: float
    finish_reason: str | None
    # Speculative decoding: steps that verified drafts, drafts verified, drafts accepted (all 0 without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens; None when none was verified."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @classmethod
    def of(cls, request: Request) -> RequestStats:
        t = request.times
        end = t.finished_s if t.finished_s is not None else t.arrival_s
        first_token = t.first_token_s if t.first_token_s is not None else end
        last_token = t.last_token_s if t.last_token_s is not None else first_token
        n = request.num_output_tokens
        return cls(
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=n,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            queue_time_s=(t.first_scheduled_s if t.first_scheduled_s is not None else end) - t.arrival_s,
            ttft_s=first_token - t.arrival_s,
            tpot_s=(last_token - first_token) / (n - 1) if n > 1 else 0.0,
            e2e_latency_s=end - t.arrival_s,
            finish_reason=request.status.finish_reason,
            spec_num_drafts=request.spec.num_drafts,
            spec_num_draft_tokens=request.spec.num_draft_tokens,
            spec_num_accepted_tokens=request.spec.num_accepted_tokens,
        )


@dataclass(kw_only=True)
class EngineStats:
    """A snapshot: gauges as of now, counters since the engine started."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_receiving_kv: int = 0  # a decode worker's reservations whose prompt KV is on its way
    num_queued_prompt_tokens: int = 0  # prompt tokens the waiting and running requests have yet to compute
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks referenced by requests
    prefix_cache_queries: int = 0  # prompt tokens looked up (vLLM counts tokens)
    prefix_cache_hits: int = 0  # of which served from the device cache
    # Prompt tokens served without computing them, by tier: "device" (prefix_cache_hits), and the KV offload tier's
    # ("disk" or "host") when there is one: vLLM's prefix_cache_hits with a tier label.
    prefix_cache_hits_by_tier: dict[str, int] = field(default_factory=dict)
    kv_offload: TierStats | None = None  # the KV offload tier's counters; None: no tier
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Speculative decoding, vLLM's spec_decode_* counters: verifications, draft tokens verified, accepted (in all
    # and per draft position); and how often the policy chose each k (0: no drafts) for a decoding request.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_decode_chosen_k: dict[int, int] = field(default_factory=dict)
    # LoRA adapters (--enable-lora): running and waiting requests by adapter name (vLLM's lora_requests_info).
    lora_requests_running: dict[str, int] = field(default_factory=dict)
    lora_requests_waiting: dict[str, int] = field(default_factory=dict)
    finished: list[RequestStats] = field(default_factory=list)


def requests_by_adapter(requests: Iterable[Request]) -> dict[str, int]:
    """How many of `requests` run under each LoRA adapter, by its name."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora is not None:
            name = request.lora.name  # type: ignore[attr-defined]  # a LoRAAdapter (opaque to the control plane)
            counts[name] = counts.get(name, 0) + 1
    return counts
