"""What the engine hands back per request and step. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.stats import RequestStats
from engine.request.logprobs import TokenLogprobs
from engine.request.stop_reason import StopReason


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens so far (not the prompt)
    text: str  # generated text so far, stop string excluded unless asked for
    new_token_ids: list[int] = field(default_factory=list)  # produced by this step
    delta_text: str = ""  # text released by this step
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked for
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: StopReason = None  # the stop token id or stop string, if one ended it
    error: str | None = None
    stats: RequestStats | None = None  # set when finished
    index: int = 0  # the choice (n > 1), engine/core/fork.py
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first output with a token, when asked for


@dataclass(frozen=True, kw_only=True)
class RemoteReservation:
    """The blocks a decode worker reserved for a prompt computed elsewhere."""

    block_ids: list[int]  # the request's block table: the prompt's blocks and its first token's
    num_held_blocks: int  # its leading blocks already here (a prefix-cache hit, shared): they need not travel
