"""The OpenAI request bodies the router accepts, and their conversion to the workers' `SamplingParams`.

Field names and defaults follow OpenAI's API plus vLLM's extensions (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, ...). Unknown fields are ignored, as vLLM does. Values are checked by
the engine's own `SamplingParams.validate()`, so the router rejects exactly what a worker would, before any
worker sees the request.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engine.core.sampling_params import SamplingParams
from protos import serving_pb2
from router.errors import ApiError, bad_request

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted for vLLM compatibility; usage comes once, at the end


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is one text, or one token-id list (also as one-element lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # None: RouterConfig.default_completion_max_tokens (16, as OpenAI)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One chat message; `content` is text or a list of text parts (other part types are rejected)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, object]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; either works
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    response_format: dict[str, object] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def check_model(model: str, served_model_names: tuple[str, ...]) -> None:
    """404 for a model this server does not serve, as vLLM and OpenAI answer it (clients raise NotFoundError)."""
    if model not in served_model_names:
        raise ApiError(
            status_code=404,
            message=f"the model {model!r} does not exist; this server serves {', '.join(served_model_names)}",
            param="model",
        )


def check_completion_request(request: CompletionRequest) -> None:
    """400 for the fields the router does not support (before any tokenization)."""
    _check_common(request)
    if request.echo:
        raise bad_request("echo is not supported", "echo")
    if request.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1, got {request.best_of}", "best_of")
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")


def check_chat_request(request: ChatCompletionRequest) -> None:
    _check_common(request)
    if request.tools:
        raise bad_request("tools are not supported", "tools")
    if request.response_format is not None and request.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")


def num_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many top alternatives to return per token; None when the request wants no logprobs."""
    if isinstance(request, ChatCompletionRequest):
        if not request.logprobs:
            return None
        return request.top_logprobs if request.top_logprobs is not None else 0
    return request.logprobs


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int
) -> serving_pb2.SamplingParams:
    """The workers' SamplingParams for `request`, generating at most `max_tokens` (already fitted to the context).

    Validated by the engine's `SamplingParams.validate()`; a bad value is a 400 naming the parameter.
    """
    defaults = SamplingParams()
    engine_params = SamplingParams(
        n=request.n,
        temperature=_or(request.temperature, defaults.temperature),
        top_p=_or(request.top_p, defaults.top_p),
        top_k=_or(request.top_k, defaults.top_k),
        min_p=_or(request.min_p, defaults.min_p),
        repetition_penalty=_or(request.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_or(request.presence_penalty, defaults.presence_penalty),
        frequency_penalty=_or(request.frequency_penalty, defaults.frequency_penalty),
        seed=request.seed,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=stop_strings(request),
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=num_logprobs(request),
        skip_special_tokens=request.skip_special_tokens,
    )
    try:
        engine_params.validate()
    except ValueError as error:
        raise bad_request(str(error), _param_of(str(error), request)) from error
    if engine_params.stop_token_ids and max(engine_params.stop_token_ids) >= 2**32:
        raise bad_request("stop_token_ids must be below 2**32", "stop_token_ids")

    params = serving_pb2.SamplingParams(
        temperature=engine_params.temperature,
        top_p=engine_params.top_p,
        top_k=engine_params.top_k,
        min_p=engine_params.min_p,
        repetition_penalty=engine_params.repetition_penalty,
        presence_penalty=engine_params.presence_penalty,
        frequency_penalty=engine_params.frequency_penalty,
        max_tokens=max_tokens,
        min_tokens=engine_params.min_tokens,
        stop=engine_params.stop,
        stop_token_ids=engine_params.stop_token_ids,
        ignore_eos=engine_params.ignore_eos,
        include_stop_str_in_output=engine_params.include_stop_str_in_output,
        skip_special_tokens=engine_params.skip_special_tokens,
    )
    if engine_params.seed is not None:
        params.seed = _as_int64(engine_params.seed)
    if engine_params.logprobs is not None:
        params.logprobs = engine_params.logprobs
    return params


def stop_strings(request: CompletionRequest | ChatCompletionRequest) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else list(request.stop)


def _check_common(request: CompletionRequest | ChatCompletionRequest) -> None:
    if request.n != 1:
        raise bad_request(f"n must be 1 (one choice per request), got {request.n}", "n")
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")


def _or(value: float | int | None, default: float | int) -> float | int:
    return default if value is None else value


def _as_int64(seed: int) -> int:
    """The proto field is int64; seeds in [2**63, 2**64) travel as their two's complement, which seeds a
    torch.Generator identically (manual_seed maps negative seeds onto the same uint64)."""
    return seed - 2**64 if seed > _INT64_MAX else seed


def _param_of(message: str, request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The parameter a `SamplingParams.validate()` message names: it starts with the field's name."""
    first_word = message.split(" ", 1)[0]
    if first_word == "stop":
        return "stop"
    if first_word == "logprobs" and isinstance(request, ChatCompletionRequest):
        return "top_logprobs"
    if first_word == "max_tokens" and isinstance(request, ChatCompletionRequest):
        return "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    return first_word if first_word in SamplingParams.__dataclass_fields__ else None

