"""OpenAI response bodies and stream chunks, in OpenAI's exact shapes, built from the workers' messages.

    completions  {"id": "cmpl-…", "object": "text_completion", "created", "model",
                  "choices": [{"index": 0, "text", "logprobs", "finish_reason", "stop_reason"}], "usage"}
    chat         {"id": "chatcmpl-…", "object": "chat.completion", …,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content"}, "logprobs",
                               "finish_reason", "stop_reason"}], "usage"}
    chunks       the same with "object": "text_completion" / "chat.completion.chunk", "text" / "delta", and
                 "usage": null on every chunk when the client asked for stream_options.include_usage (with
                 vLLM's continuous_usage_stats, the usage so far), whose final chunk then has "choices": [] and
                 the usage.

`stop_reason` is vLLM's extension: the stop string (str) or stop token id (int) that ended the request, null
for EOS or length. Logprobs below -9999 (and -inf) are written as -9999.0, as vLLM does, since JSON has no -inf.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engine.request.stop_reason import StopReason
from engine.request.wire import stop_reason_from_proto
from protos import serving_pb2

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0
SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True, kw_only=True)
class ResponseHeader:
    """What every body and chunk of one request repeats."""

    request_id: str  # "cmpl-<hex>" or "chatcmpl-<hex>"
    created: int  # unix seconds
    model: str  # the name the request used
    chat: bool


@dataclass(frozen=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def openai_stop_reason(message: serving_pb2.GenerateResponse) -> StopReason:
    """A finished message's stop reason as vLLM reports it: the stop string (str) or stop token id (int) that
    ended it; None for EOS and for any finish other than "stop"."""
    if message.finish_reason != "stop":
        return None
    return stop_reason_from_proto(message.stop_reason)


# -- bodies --------------------------------------------------------------------------------------------------


def response_body(
    header: ResponseHeader,
    *,
    text: str | None,
    finish_reason: str,
    stop_reason: str | int | None,
    logprobs: dict[str, Any] | None,
    usage: Usage,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The non-streaming body of a completion or chat completion with one choice; chat's message carries
    `tool_calls` when given (then `text` may be None)."""
    choice = choice_body(header, index=0, text=text, finish_reason=finish_reason, stop_reason=stop_reason,
                         logprobs=logprobs, tool_calls=tool_calls)
    return choices_response_body(header, [choice], usage)


def choice_body(
    header: ResponseHeader,
    *,
    index: int,
    text: str | None,
    finish_reason: str,
    stop_reason: str | int | None,
    logprobs: dict[str, Any] | None,
    tool_calls: list[dict[str, Any]] | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One choice of a non-streaming body; chat's message carries `tool_calls` when given (then `text` may be
    None); `token_ids` (vLLM's return_token_ids): the choice's generated token ids."""
    choice: dict[str, Any] = {"index": index}
    if header.chat:
        choice["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            choice["message"]["tool_calls"] = tool_calls
    else:
        choice["text"] = text
    choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def choices_response_body(
    header: ResponseHeader, choices: list[dict[str, Any]], usage: Usage,
    prompt_logprobs: list[dict[str, Any] | None] | None = None, *, prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The non-streaming body of a completion or chat completion (n choices). vLLM's `prompt_logprobs` and
    `prompt_token_ids` (return_token_ids), when asked for: on each choice of a completion, on the body of a chat
    completion (where vLLM puts them)."""
    body = {
        "id": header.request_id,
        "object": "chat.completion" if header.chat else "text_completion",
        "created": header.created,
        "model": header.model,
        "choices": choices,
        "usage": usage.body(),
    }
    for name, value in (("prompt_logprobs", prompt_logprobs), ("prompt_token_ids", prompt_token_ids)):
        if value is not None:
            if header.chat:
                body[name] = value
            else:
                for choice in choices:
                    choice[name] = value
    return body


def chunk_body(
    header: ResponseHeader,
    *,
    text: str | None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: dict[str, Any] | None = None,
    include_usage: bool = False,
    usage: Usage | None = None,
    role: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
    index: int = 0,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One stream chunk of choice `index`. Chat: `role` makes the opening delta {"role": "assistant",
    "content": ""}; `tool_calls` are tool-call deltas (router/tools.py). `include_usage`: the chunk's "usage" is
    null, or `usage` (vLLM's continuous_usage_stats). vLLM's return_token_ids: the chunk's
    `token_ids`, and `prompt_token_ids` (on the choice in a completion, on the body in chat)."""
    choice: dict[str, Any] = {"index": index}
    if header.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = _chunk_head(header)
    if prompt_token_ids is not None:
        (body if header.chat else choice)["prompt_token_ids"] = prompt_token_ids
    body["choices"] = [choice]
    if include_usage:
        body["usage"] = None if usage is None else usage.body()
    return body


def usage_chunk_body(header: ResponseHeader, usage: Usage) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the request's usage."""
    body = _chunk_head(header)
    body["choices"] = []
    body["usage"] = usage.body()
    return body


def _chunk_head(header: ResponseHeader) -> dict[str, Any]:
    return {
        "id": header.request_id,
        "object": "chat.completion.chunk" if header.chat else "text_completion",
        "created": header.created,
        "model": header.model,
    }


# -- logprobs ------------------------------------------------------------------------------------------------


class TokenNames(Protocol):
    """What names the tokens in logprobs: the tokenizer (their text), or TokenIdNames."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes: ...


class TokenIdNames:
    """vLLM's `--return-tokens-as-token-ids` (and its request field): a token in logprobs is "token_id:<id>", so
    that a client gets the ids themselves, tokens that are no text of their own (a piece of a UTF-8 character)
    included; its `bytes` in chat are those of that name, as vLLM's."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"token_id:{token_id}" for token_id in ids)

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        return self.decode(ids).encode()


def completion_logprobs(
    entries: Sequence[serving_pb2.TokenLogprobs], tokenizer: TokenNames, *, text_offset: int = 0
) -> tuple[dict[str, Any], int]:
    """Completions' logprobs shape for `entries`, and the text offset after them (for the next chunk).

        {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{token: logprob}], "text_offset": [int]}

    Each top_logprobs dict holds the top alternatives plus the sampled token, as in vLLM (so up to n + 1 keys).
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for entry in entries:
        token = token_text(tokenizer, entry.token_id)
        tokens.append(token)
        token_logprobs.append(_finite(entry.logprob))
        top = {token_text(tokenizer, alt.token_id): _finite(alt.logprob) for alt in entry.top}
        top.setdefault(token, _finite(entry.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
    return body, text_offset


def echo_logprobs(
    prompt_token_ids: Sequence[int], entries: Sequence[serving_pb2.TokenLogprobs], tokenizer: TokenNames
) -> tuple[dict[str, Any], int]:
    """Completions' logprobs of an echoed prompt, as OpenAI writes them: the first prompt token has no logprob
    (null, and null top_logprobs); `entries` are the prompt logprobs of the tokens after it. Returns the body
    and the text offset after the prompt, where the generated tokens' offsets go on."""
    first = token_text(tokenizer, prompt_token_ids[0])
    body, text_offset = completion_logprobs(entries, tokenizer, text_offset=len(first))
    body["tokens"].insert(0, first)
    body["token_logprobs"].insert(0, None)
    body["top_logprobs"].insert(0, None)
    body["text_offset"].insert(0, 0)
    return body, text_offset


def join_completion_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two completions' logprobs bodies, one after the other (an echoed prompt's, then the output's)."""
    return {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def vllm_prompt_logprobs(
    entries: Sequence[serving_pb2.TokenLogprobs], tokenizer: Tokenizer
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` shape: None for the first prompt token, then per token {token id: {"logprob",
    "rank", "decoded_token"}} holding the prompt token and the top alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for entry in entries:
        item = {str(alt.token_id): {"logprob": _finite(alt.logprob), "rank": rank,
                                    "decoded_token": token_text(tokenizer, alt.token_id)}
                for rank, alt in enumerate(entry.top, start=1)}
        item[str(entry.token_id)] = {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                     "decoded_token": token_text(tokenizer, entry.token_id)}
        out.append(item)
    return out


def chat_logprobs(entries: Sequence[serving_pb2.TokenLogprobs], tokenizer: TokenNames) -> dict[str, Any]:
    """Chat's logprobs shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}], "refusal": null}."""
    content = []
    for entry in entries:
        item = _chat_token(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_chat_token(tokenizer, alt.token_id, alt.logprob) for alt in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}


def token_text(tokenizer: TokenNames, token_id: int) -> str:
    """One token's text, special tokens spelled out (an EOS shows as its name, not as nothing)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_token(tokenizer: TokenNames, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.decode_bytes([token_id], skip_special_tokens=False)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR
