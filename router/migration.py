"""Request migration: what the gateway does when the decode worker under a live stream goes away.

    Generate stream on decode-0 ──tokens t1..tk──▶ client
        │ the call fails with "worker gone" (below)
        ▼
    resumed_job: prompt + [t1..tk], max_tokens − k, min_tokens − k, same seed and stop lists, id "<id>-m<n>"
        │ Dispatcher.resume: routed as any request (a prefill worker, or a local prefill), decode-0 excluded
        ▼
    Generate stream on decode-1 ──t(k+1)..──▶ TextContinuation rewrites each message's text_delta ──▶ client

Which failures mean "the worker is gone" (`worker_gone`), and so are migrated:
- UNAVAILABLE: the worker's process died or its server stopped. Measured with grpcio's aio client: a SIGKILLed
  server process gives UNAVAILABLE "Stream removed (Socket closed)"; a server stopped without grace (a drain whose
  grace ran out) gives UNAVAILABLE "Cancelling all calls".
- UNKNOWN whose details say "Stream removed": the same cut HTTP/2 stream as other gRPC versions report it — the
  transport's words, never a worker's own error (a worker's own exception is UNKNOWN "Exception iterating ...").
- CANCELLED: the gateway never reads a call it cancelled itself, so a CANCELLED read means the server side
  cancelled it (a worker shutting down), or the registry closed the channel of a worker that left the list
  (GenerationStream raises that read, which grpc.aio gives as asyncio.CancelledError, as CANCELLED).
Everything else is the request's own fate and is not retried: INVALID_ARGUMENT / OUT_OF_RANGE (a bad request
would fail anywhere), RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED (the request's deadline is spent), INTERNAL, and a
message with finish_reason "abort" or "error" (the worker answered; an abort may be an operator's Abort).

What the resumed request carries: the original prompt plus every token id already streamed, as its prompt
(recomputed by prefill, as a preempted request is, so greedy output continues exactly); `max_tokens` and
`min_tokens` less the tokens produced (an unset max_tokens stays unset: the worker bounds prompt + output by
max_model_len, the same total); every other sampling parameter unchanged. Known limits, as for any scheme that
resends the output as prompt (Dynamo's migration does the same): a seeded sampler restarts its random stream
from the seed at the migration point (reproducible for the same migration point, not equal to an undisturbed
seeded run); presence and frequency penalties, which count output tokens only, no longer see the tokens before
the migration point.

Text: the workers detokenize incrementally (engine/tokenizer/detokenizer.py), holding back an unfinished UTF-8
character and any tail that may begin a stop string. A resumed worker starts that state afresh, so its
`text_delta`s would drop what the first worker held back and miss a stop string that spans the boundary.
`TextContinuation` therefore replays the streamed ids through the same IncrementalDetokenizer (which then holds
exactly what the first worker held: same algorithm, same ids), and from then on the gateway derives each
message's text from its token ids; the resumed worker's own text is ignored. A stop string the gateway finds
ends the request there ("stop", its stop_reason), and the rest of that worker's stream is cancelled.

Usage: prompt_tokens stays the original prompt's length; completion_tokens counts every token streamed, before
and after the migration (GenerationStream's `num_prior_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from engine.request.sampling_params import SamplingParams
from engine.tokenizer.detokenizer import IncrementalDetokenizer  # torch-free

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer


# Reasons for splitserve:request_migrations_total{reason}
WORKER_UNAVAILABLE = "worker_unavailable"
STREAM_CUT = "stream_cut"
SERVER_CANCELLED = "server_cancelled"


def worker_gone(code: grpc.StatusCode, details: str) -> str | None:
    """The migration reason when a failed Generate call means its worker is gone; None for a request error."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return WORKER_UNAVAILABLE
    if code == grpc.StatusCode.UNKNOWN and "Stream removed" in details:
        return STREAM_CUT
    if code == grpc.StatusCode.CANCELLED:
        return SERVER_CANCELLED
    return None


@dataclass(frozen=True, kw_only=True)
class ResumedRequest:
    """What the next worker is asked for: `prompt_token_ids` (original prompt + streamed ids) and `params`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_prior_tokens: int  # tokens streamed before the migration, now the end of the prompt


def resume_request(
    *, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
    streamed_token_ids: Sequence[int], num_migrations: int,
) -> ResumedRequest | None:
    """The request that continues after `streamed_token_ids`, on its `num_migrations`-th migration (1-based);
    None when nothing is left to generate (max_tokens already reached)."""
    num_prior = len(streamed_token_ids)
    max_tokens = params.max_tokens
    if max_tokens is not None:
        if max_tokens <= num_prior:
            return None
        max_tokens -= num_prior
    return ResumedRequest(
        request_id=f"{request_id}-m{num_migrations}",
        prompt_token_ids=[*prompt_token_ids, *streamed_token_ids],
        params=dataclasses.replace(params, max_tokens=max_tokens, min_tokens=max(params.min_tokens - num_prior, 0)),
        num_prior_tokens=num_prior,
    )


@dataclass(frozen=True, kw_only=True)
class TextStep:
    """One resumed message's share of the output: the text to stream, the token ids and logprobs kept (cut after
    the token that completed a stop string) and the stop string found, if any."""

    text_delta: str
    num_tokens_kept: int
    stop_str: str | None = None


class TextContinuation:
    """The gateway's detokenizer for a migrated request; see the module docstring.

    Lifecycle: `TextContinuation(tokenizer, params, streamed_ids)` once (replays what the client already has),
    then `step` for each resumed message's token ids, then `finish` once when the worker finishes (not after a
    stop string was found)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, streamed_token_ids: Sequence[int]) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=tuple(params.stop),
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        for token_id in streamed_token_ids:  # what the first worker streamed, and what it held back
            self._detokenizer.add_token(token_id)

    @property
    def stopped(self) -> bool:
        return self._detokenizer.stopped

    def step(self, token_ids: Sequence[int]) -> TextStep:
        text = ""
        for num_kept, token_id in enumerate(token_ids, start=1):
            text += self._detokenizer.add_token(token_id)
            if self._detokenizer.stopped:
                return TextStep(text_delta=text, num_tokens_kept=num_kept, stop_str=self._detokenizer.stop_str)
        return TextStep(text_delta=text, num_tokens_kept=len(token_ids))

    def finish(self) -> str:
        """What is still held back when generation ends (a partial stop string, an unfinished character)."""
        return self._detokenizer.finish()
