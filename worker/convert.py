"""The engine's outputs as the worker services stream them. No torch. (The request contract's own messages are
engine/request/wire.py's.)"""

from __future__ import annotations

from engine.outputs import RequestOutput
from engine.request.wire import logprobs_to_proto, stop_reason_to_proto
from protos import serving_pb2


def output_to_response(out: RequestOutput) -> serving_pb2.GenerateResponse:
    """One step's output as a stream message: the new tokens, their text and logprobs; usage when finished."""
    msg = serving_pb2.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text_delta=out.delta_text, index=out.index
    )
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in out.prompt_logprobs)
    if out.logprobs is not None and out.new_token_ids:
        msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs[-len(out.new_token_ids) :])
    if out.finished:
        msg.finish_reason = out.finish_reason or ""
        if out.stop_reason is not None:
            msg.stop_reason.CopyFrom(stop_reason_to_proto(out.stop_reason))
        msg.error = out.error or ""
        msg.usage.prompt_tokens = len(out.prompt_token_ids)
        msg.usage.completion_tokens = len(out.token_ids)
        if out.stats is not None:
            msg.usage.cached_tokens = out.stats.num_cached_tokens
    return msg
