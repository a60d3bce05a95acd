"""The OpenAI request bodies the router accepts, and their conversion to the workers' `SamplingParams`.

Field names and defaults follow OpenAI's API plus vLLM's extensions (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, ...). Unknown fields are ignored, as vLLM does. The body fields that are
SamplingParams fields of the same name and meaning are copied by its field table (`BODY_FIELDS`); the rest
(best_of, logit_bias, logprobs, prompt_logprobs, max_tokens, structured outputs) are derived here. Values are
checked by the engine's own `SamplingParams.validate()`, so the router rejects exactly what a worker would,
before any worker sees the request.

Bad input stays a 4xx: the models take the shapes and the list sizes (they are what /openapi.json publishes),
`check_*_request` the text (valid Unicode, no NUL in what becomes the prompt) and the logit_bias keys, and
`to_sampling_params` the values, including those `validate()` accepts but the protobuf fields of
protos/serving.proto cannot carry. `to_sampling_params` returns the validated SamplingParams; the dispatcher puts
them on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from types import MappingProxyType
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from engine.request.grammar_spec import GrammarSpec
from engine.request.sampling_params import BODY_FIELDS, DEFAULT_MAX_LOGPROBS, SamplingParams, check_engine_rules
from engine.request.wire import check_fits_wire
from router.errors import bad_request

# Caps on the stop conditions a request carries to a worker. Within the body-size limit alone, a stop list could
# make the Generate message pass the workers' 4 MiB gRPC receive limit, a 503 for what is bad input; capped, it
# adds at most 1 MiB (64 x 4096 characters) and 5 KiB of ids. OpenAI allows 4 stop strings, TGI 4 by default;
# vLLM sets no cap.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI documents no cap; OpenAI's own API takes 300 entries
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary served here
# Prompts in one batched /v1/completions request, each a request of its own to the workers (OpenAI takes 2048).
MAX_BATCH_PROMPTS = 1024
MAX_BAD_WORDS = 1024  # vLLM sets no cap; each word is held to MAX_STOP_STRING_CHARS as a stop string is


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    # The list caps are in the schema; a stop string's length is checked by check_*_request: a length
    # constraint here would make pydantic refuse a lone surrogate itself, with a message naming no cause.
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
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
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    # vLLM's: only these tokens may be sampled
    allowed_token_ids: Annotated[list[int], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None  # vLLM's: never in the output
    prompt_logprobs: int | None = None  # vLLM's
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last this many tokens (-1: max_model_len)
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower values are served first
    request_id: str | None = None  # vLLM's: the response's id is "cmpl-<request_id>" (router/request_ids.py)
    # vLLM's: logprobs name tokens "token_id:<id>" (None: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool = False  # vLLM's: the answer carries the prompt's token ids and each choice's
    user: str | None = None
    # Structured outputs (router/structured.py): OpenAI's response_format, vLLM's guided fields and object.
    response_format: dict[str, object] | None = None
    guided_json: str | dict[str, object] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, object] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @cached_property
    def token_logit_bias(self) -> dict[int, float]:
        """logit_bias with integer keys (JSON keys are strings), parsed once; a 400 for a key that is no integer.
        The values' range is `SamplingParams.validate()`'s to check, the ids' the tokenizer's (router/prompt.py)."""
        biases: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r:.40}",
                                  "logit_bias") from None
            if not 0 <= token_id < 2**32:
                raise bad_request(f"logit_bias token ids must be in [0, vocab_size), got {token_id}", "logit_bias")
            biases[token_id] = bias
        return biases


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is one text, or one token-id list (also as one-element lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # None: RouterConfig.default_completion_max_tokens (16, as OpenAI)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt


class ContentPart(BaseModel):
    """One part of a message's content. Only {"type": "text", "text": ...} is served; other types (image_url,
    input_audio, ...) parse, for a clear 400 naming them rather than a schema error."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message; `content` is text or a list of text parts (other part types are rejected)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, object]] | None = None  # an assistant turn's calls (router/tools.py renders them)
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; either works
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the last message, for the model to go on
    chat_template_kwargs: dict[str, object] | None = None  # vLLM's: more variables for the chat template
    chat_template: str | None = None  # vLLM's: this request's own (--trust-request-chat-template)
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the rendered template is tokenized with the tokenizer's special tokens too (the template writes its own)
    add_special_tokens: bool = False
    echo: bool = False  # vLLM's: an assistant message last in `messages` opens each choice's content

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def check_completion_request(request: CompletionRequest) -> None:
    """400 for the fields the router does not support and for text that is not valid Unicode (before any
    tokenization): see `check_text`."""
    _check_common(request)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise bad_request(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}", "prompt")
        if any(not p for p in prompt):
            raise bad_request("prompt must not be empty (a batch's prompts neither)", "prompt")
    if isinstance(request.prompt, str):
        check_text(request.prompt, param="prompt", allow_nul=False)
    elif request.prompt and isinstance(request.prompt[0], str):
        for index, text in enumerate(request.prompt):
            check_text(text, param="prompt", where=f"prompt[{index}]", allow_nul=False)  # type: ignore[arg-type]
    if request.suffix is not None:
        check_text(request.suffix, param="suffix")
    if request.best_of is not None and request.best_of != request.n and request.stream:
        raise bad_request("best_of is not supported with stream (the best choices are known only at the end)",
                          "best_of")
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")


def check_chat_request(request: ChatCompletionRequest) -> None:
    """400 for the fields the router does not support and for text that is not valid Unicode (before the chat
    template renders it): see `check_text`."""
    _check_common(request)
    for index, message in enumerate(request.messages):
        _check_message_text(message, f"messages[{index}]")
    if isinstance(request.tool_choice, str):
        check_text(request.tool_choice, param="tool_choice")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    check_json_text(request.chat_template_kwargs, "chat_template_kwargs")
    if request.chat_template is not None:
        check_text(request.chat_template, param="chat_template", allow_nul=False)


def check_text(text: str, *, param: str, where: str | None = None, allow_nul: bool = True) -> None:
    """400 naming `param` when `text` is not valid Unicode text or, unless `allow_nul`, holds a NUL.

    JSON may escape a lone surrogate ("\\ud800"), and Python's json decodes the raw bytes ED A0 80 to one as
    well; such a string cannot be encoded as UTF-8, so it can reach neither the tokenizer nor a protobuf
    `string` field. The check_*_request functions hold every declared string field to this, used or not, so
    that one rule answers for all of them. NUL is no character of any prompt; refusing it in the text that
    becomes the prompt (prompt, messages) keeps it from meaning something else to each C-string consumer
    downstream (tokenizers in C, logs). `where` says where the text sits (e.g. "messages[2].content"), default
    `param`. The fields of a free-form object (tools, response_format, structured_outputs) are not walked here:
    what the router takes from them is checked where it is read, or travels re-serialized as ASCII JSON;
    logit_bias keys must parse as integers.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code_point = ord(text[error.start])
        raise bad_request(f"{where or param} holds a lone surrogate (U+{code_point:04X} at index {error.start}), "
                          "which is not valid Unicode text", param) from None
    if not allow_nul and "\x00" in text:
        raise bad_request(f"{where or param} holds a NUL character (at index {text.index(chr(0))})", param)


def num_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many top alternatives to return per token; None when the request wants no logprobs."""
    if isinstance(request, ChatCompletionRequest):
        if not request.logprobs:
            return None
        return request.top_logprobs if request.top_logprobs is not None else 0
    return request.logprobs


def num_prompt_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """vLLM's prompt_logprobs; a completion with echo and logprobs asks for them too (OpenAI's echo shape)."""
    echoed = request.logprobs if isinstance(request, CompletionRequest) and request.echo else None
    if echoed is None:
        return request.prompt_logprobs
    return echoed if request.prompt_logprobs is None else max(echoed, request.prompt_logprobs)


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
    structured_outputs: GrammarSpec | None = None, defaults: Mapping[str, object] = MappingProxyType({}),
    scheduling_policy: str = "fcfs", max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> SamplingParams:
    """The workers' SamplingParams for `request`, generating at most `max_tokens` (already fitted to the context),
    its output following `structured_outputs` (router/structured.py, router/tools.py) when given; `defaults`: the
    model's values of the fields the request leaves unset (engine/request/generation_config.py);
    `scheduling_policy` and `max_logprobs`: the workers' (a priority other than 0 needs "priority"; more logprobs
    than `max_logprobs` are refused).

    Validated by the engine's `SamplingParams.validate()` and fit for the wire (`check_fits_wire`); a bad value is a
    400 naming the parameter.
    """
    best_of = request.best_of if isinstance(request, CompletionRequest) else None
    logprobs = num_logprobs(request)
    if best_of is not None and best_of > request.n and logprobs is None:
        logprobs = 0  # the best choices are those of highest cumulative logprob: the router ranks them
    same_named = {name: value for name, value in defaults.items() if name in BODY_FIELDS}
    same_named.update({name: getattr(request, name) for name in BODY_FIELDS if getattr(request, name) is not None})
    params = SamplingParams(
        **same_named,
        best_of=best_of,
        logit_bias=request.token_logit_bias,
        prompt_logprobs=num_prompt_logprobs(request),
        max_tokens=max_tokens,
        logprobs=logprobs,
        structured_outputs=structured_outputs,
    )
    try:
        params.validate()
        check_fits_wire(params)
        check_engine_rules(params, scheduling_policy=scheduling_policy, max_logprobs=max_logprobs)
    except ValueError as error:
        raise bad_request(str(error), _param_of(str(error), request)) from error
    return params


def stop_strings(request: CompletionRequest | ChatCompletionRequest) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else list(request.stop)


def _check_common(request: CompletionRequest | ChatCompletionRequest) -> None:
    request.token_logit_bias  # noqa: B018 - parsed here: 400 on a key that is no token id
    for name in ("user", "request_id"):
        if getattr(request, name) is not None:
            check_text(getattr(request, name), param=name)
    for name in ("guided_regex", "guided_grammar"):
        if getattr(request, name) is not None:
            check_text(getattr(request, name), param=name)
    for index, choice in enumerate(request.guided_choice or ()):
        check_text(choice, param="guided_choice", where=f"guided_choice[{index}]")
    for index, stop in enumerate(stop_strings(request)):
        where = "stop" if isinstance(request.stop, str) else f"stop[{index}]"
        check_text(stop, param="stop", where=where)
        _check_length(stop, where, "stop")
    for index, word in enumerate(request.bad_words or ()):
        check_text(word, param="bad_words", where=f"bad_words[{index}]")
        _check_length(word, f"bad_words[{index}]", "bad_words")


def _check_length(text: str, where: str, param: str) -> None:
    if len(text) > MAX_STOP_STRING_CHARS:
        raise bad_request(f"{where} must be at most {MAX_STOP_STRING_CHARS} characters, got {len(text)}", param)


def check_json_text(value: object, param: str, where: str | None = None) -> None:
    """Every string in the JSON value `param` (keys too): valid Unicode, no NUL (a chat template writes them into
    the prompt)."""
    where = where or param
    if isinstance(value, str):
        check_text(value, param=param, where=where, allow_nul=False)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_json_text(key, param, f"a key of {where}")
            check_json_text(item, param, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_text(item, param, f"{where}[{index}]")


def _check_message_text(message: ChatMessage, where: str) -> None:
    """Role, name and text become the chat prompt: valid Unicode, no NUL; a part's type: valid Unicode."""
    check_text(message.role, param="messages", where=f"{where}.role", allow_nul=False)
    if message.name is not None:
        check_text(message.name, param="messages", where=f"{where}.name", allow_nul=False)
    if message.tool_call_id is not None:
        check_text(message.tool_call_id, param="messages", where=f"{where}.tool_call_id", allow_nul=False)
    if isinstance(message.content, str):
        check_text(message.content, param="messages", where=f"{where}.content", allow_nul=False)
    for index, part in enumerate(message.content if isinstance(message.content, list) else ()):
        check_text(part.type, param="messages", where=f"{where}.content[{index}].type")
        if part.text is not None:
            check_text(part.text, param="messages", where=f"{where}.content[{index}].text", allow_nul=False)


def _param_of(message: str, request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The parameter a `SamplingParams.validate()` message names: it starts with the field's name."""
    first_word = message.split(" ", 1)[0]
    if first_word == "stop":
        return "stop"
    if first_word == "prompt_logprobs" and request.prompt_logprobs is None:
        return "logprobs"  # asked for through echo
    if first_word == "logprobs" and isinstance(request, ChatCompletionRequest):
        return "top_logprobs"
    if first_word == "max_tokens" and isinstance(request, ChatCompletionRequest):
        return "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    return first_word if first_word in SamplingParams.__dataclass_fields__ else None

