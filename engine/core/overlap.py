"""Async scheduling (vLLM's `--async-scheduling`): which steps overlap, decided on the control plane. No torch.

With it on, the engine schedules step N+1 while step N still runs on the device, and processes N's outputs after
launching N+1:

    host    [schedule N+1 | inputs N+1 | launch N+1 | wait N | update N, detokenize, stream N ] [schedule N+2 ...
    device  [ ...... step N ...... ][ ............... step N+1 ............... ][ step N+2 ...

A request that samples in step N has a placeholder in step N+1: its next input token is N's sampled token, which
the runner takes from N's output on the device (`ScheduledRequest.takes_last_sample`); the host reads N's tokens
back afterwards. The scheduler sees the step in flight as if it had run (`Scheduler.schedule(in_flight=...)`):
each request's computed count plus its tokens in flight, its token count plus its placeholder.

A request that arrives (added, or committed after its KV handoff) has no token in flight: the next step admits it
whether or not it is scheduled ahead. A request in step N is left out of step N+1 when N's token surely ends it (`finishes_with_in_flight_token`): its
length cap, or a prefill worker's request, whose KV is handed off after its first token. When N's token ends it
otherwise (EOS, a stop token id or string, an abort), step N+1 has already run it: that step's token is discarded
(the request is finished when N+1's output comes in: `update_from_output` skips it, nothing is streamed), and its
blocks, the extra slot's included, went back with the rest when it finished. Every reader and writer of the KV
cache in this process (the steps, the KV transports' copies) runs on the device's default stream, so a block freed
while step N+1 still writes into it is reused only after that write.

The steps that do not overlap (step N's output is processed first, then N+1 is scheduled as without async):
- a request of step N that continues needs N's token on the host to build its next step (`needs_host_tokens`):
  penalties, min_tokens and bad_words of more than one token (they read the output tokens), n > 1 (the other
  choices fork off the first once its prompt is computed). A grammar does not: its matcher takes N's token when
  step N+1's bitmask is filled, and that
  step's sampling waits for the fill (engine/structured/matchers.py, engine/launched_step.py), not its forward;
- the running requests' next tokens would not fit in the free blocks: scheduling them could preempt a request
  whose step is in flight (its sampled token, a seeded draw, would be lost), so preemption happens only after N;
- speculative decoding, in every step (the proposer drafts from the tokens, the rejection sampler's output varies
  in length): the engine runs it synchronously throughout.
Steps that sync on the host by themselves (prompt logprobs, a grammar's bitmask filled in the step, draft
verification) still run, in order; they only gain less overlap.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.request.bad_words import needs_output_context


def needs_host_tokens(request: Request) -> bool:
    """Whether `request`'s next step needs its latest sampled token on the host (so cannot be scheduled and built
    while the step that samples it runs)."""
    params = request.sampling_params
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or request.num_output_tokens < params.min_tokens
        or bool(request.pending_forks)
        or bool(request.spec_token_ids)
        or needs_output_context(request.bad_words_token_ids)
    )


def finishes_with_in_flight_token(request: Request, max_model_len: int) -> bool:
    """Whether the token `request` samples in the step in flight surely ends it: its length cap (max_tokens or
    max_model_len, which `Scheduler._token_stop_status` checks first, unconditionally), or a prefill worker's
    request (held for its KV handoff, or finished, after its first token)."""
    return (
        request.remote_decode
        or request.num_output_tokens + 1 >= request.max_tokens
        or request.num_tokens + 1 >= max_model_len
    )
