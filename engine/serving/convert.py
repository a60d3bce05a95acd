"""Protobuf ↔ engine types for the worker services. No torch."""

from __future__ import annotations

from engine.outputs import RequestOutput
from engine.request.grammar_spec import GrammarSpec
from engine.request.logprobs import TokenLogprobs
from engine.request.sampling_params import SamplingParams
from protos import serving_pb2


def sampling_params_from_proto(msg: serving_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields keep vLLM's defaults. The result is not validated yet."""
    params = SamplingParams(
        top_k=msg.top_k,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        min_tokens=msg.min_tokens,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        n=msg.n or 1,
        logit_bias=dict(msg.logit_bias),
    )
    for name in ("temperature", "top_p", "repetition_penalty", "seed", "logprobs", "skip_special_tokens", "best_of",
                 "prompt_logprobs"):
        if msg.HasField(name):
            setattr(params, name, getattr(msg, name))
    if msg.HasField("structured_outputs"):  # the kind is checked by validate()
        params.structured_outputs = GrammarSpec(kind=msg.structured_outputs.kind,  # type: ignore[arg-type]
                                                source=msg.structured_outputs.source)
    return params


def sampling_params_to_proto(params: SamplingParams) -> serving_pb2.SamplingParams:
    msg = serving_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        n=params.n if params.n > 1 else 0,  # 0: unset, one choice
        logit_bias=params.logit_bias,
    )
    if params.best_of is not None:
        msg.best_of = params.best_of
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.seed is not None:
        # The field is int64; seeds in [2**63, 2**64) travel as their two's complement, which seeds a
        # torch.Generator identically (manual_seed maps negative seeds onto the same uint64).
        msg.seed = params.seed - 2**64 if params.seed >= 2**63 else params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured_outputs is not None:
        msg.structured_outputs.kind = params.structured_outputs.kind
        msg.structured_outputs.source = params.structured_outputs.source
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> serving_pb2.TokenLogprobs:
    return serving_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[serving_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_proto(msg: serving_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id, logprob=msg.logprob, rank=msg.rank, top=[(t.token_id, t.logprob) for t in msg.top]
    )


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
            msg.stop_reason = str(out.stop_reason)
        msg.error = out.error or ""
        msg.usage.prompt_tokens = len(out.prompt_token_ids)
        msg.usage.completion_tokens = len(out.token_ids)
        if out.stats is not None:
            msg.usage.cached_tokens = out.stats.num_cached_tokens
    return msg
