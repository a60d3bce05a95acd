"""The interface every proposer implements. No torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.core.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Up to `num_drafts[i]` draft tokens to follow `requests[i].all_token_ids` (fewer, or none, when it has
        no good guess). Called before the step's schedule, for running requests with exactly one token to
        compute; deterministic given the tokens (the rejection sampler relies on it)."""
        ...

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted, errored): drop whatever is kept for it."""
        ...
