"""Turning an open ResumableStream into the client's answer: one JSON body, or Server-Sent Events.

    SSE:  [chat: role chunk per choice] ─ one chunk per worker message that carries text, logprobs or a
          finish_reason, tagged with its choice's index ─ [usage chunk, when stream_options.include_usage] ─
          "data: [DONE]"

n > 1: the worker's one stream carries every choice; it ends after each choice's finish. best_of (not
streamed): every sequence is read, the n of highest cumulative logprob are returned (`best_choices`).

A failure after the first byte cannot change the HTTP status any more, so it becomes an error event in OpenAI's
shape, `data: {"error": {...}}`, followed by `data: [DONE]`. Both paths close the stream whatever happens,
which cancels and aborts the request on the worker unless it finished. A decode worker lost mid-stream is
replaced under the stream (router/resumable_stream.py); only a request that cannot be resumed ends in an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc.aio

from engine.request.stop_reason import StopReason
from protos import serving_pb2
from router.dispatcher import api_error_from_rpc, message_failure
from router.errors import ApiError
from router.resumable_stream import ResumableStream
from router.responses import (
    SSE_DONE,
    ResponseHeader,
    TokenIdNames,
    TokenNames,
    Usage,
    chat_logprobs,
    choice_body,
    choices_response_body,
    chunk_body,
    completion_logprobs,
    echo_logprobs,
    join_completion_logprobs,
    openai_stop_reason,
    sse_event,
    usage_chunk_body,
    vllm_prompt_logprobs,
)

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer
    from router.tools import ToolCallParser, ToolPlan


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """How one request wants its output written."""

    header: ResponseHeader
    tokenizer: Tokenizer
    num_logprobs: int | None  # None: no logprobs
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage so far on every chunk
    tools: ToolPlan | None = None  # chat with tools: the output becomes content and tool_calls (router/tools.py)
    n: int = 1  # choices returned
    num_choices: int = 1  # sequences the stream carries: best_of (the n best are returned), else n
    # echo: written before each choice's text: a completion's prompt (with its logprobs, when asked for), or chat's
    # last message, the assistant's (vLLM's)
    echo: str | None = None
    prompt_token_ids: tuple[int, ...] = ()  # for echo's logprobs and prompt_logprobs
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: returned in the body
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    return_token_ids: bool = False  # vLLM's return_token_ids: the prompt's token ids and each choice's, given back

    @property
    def token_names(self) -> TokenNames:
        """What names the tokens in logprobs (router/responses.py)."""
        return TokenIdNames() if self.tokens_as_ids else self.tokenizer


@dataclass
class _Choice:
    """One choice's messages, gathered."""

    texts: list[str] = field(default_factory=list)
    entries: list[serving_pb2.TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: StopReason = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.entries)


def best_choices(choices: dict[int, _Choice], n: int) -> list[_Choice]:
    """The choices to return: all, in index order, or (best_of > n) the n of highest cumulative logprob, best
    first, as vLLM returns them."""
    if len(choices) <= n:
        return [choices[index] for index in sorted(choices)]
    ranked = sorted(sorted(choices), key=lambda index: -choices[index].cumulative_logprob)
    return [choices[index] for index in ranked[:n]]


async def collect_response(stream: ResumableStream, spec: OutputSpec) -> dict[str, Any]:
    """Read `stream` to its end (every choice's finish) and build the non-streaming body. ApiError when the
    request failed."""
    try:
        choices: dict[int, _Choice] = {}
        prompt_entries: list[serving_pb2.TokenLogprobs] = []
        num_left = spec.num_choices
        while num_left:
            message = await _next(stream)
            if message.prompt_logprobs and not prompt_entries:
                prompt_entries = list(message.prompt_logprobs)
            choice = choices.setdefault(message.index, _Choice())
            choice.texts.append(message.text_delta)
            choice.entries.extend(message.logprobs)
            choice.token_ids.extend(message.token_ids)
            if message.finish_reason:
                choice.finish_reason, choice.stop_reason = message.finish_reason, openai_stop_reason(message)
                num_left -= 1
        selected = best_choices(choices, spec.n)
        usage = _usage(stream)
        if len(selected) < len(choices):  # best_of: usage counts the choices returned, as vLLM's
            usage = Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=sum(c.num_tokens for c in selected),
                          cached_tokens=usage.cached_tokens)
        echo_logprobs_body, echo_offset = None, 0
        if spec.echo is not None and spec.num_logprobs is not None and not spec.header.chat:
            echo_logprobs_body, echo_offset = echo_logprobs(spec.prompt_token_ids, prompt_entries, spec.token_names)
        bodies = []
        for index, choice in enumerate(selected):
            logprobs = None
            if spec.num_logprobs is not None:
                logprobs = _logprobs(choice.entries, spec, echo_offset)[0]
                if echo_logprobs_body is not None:
                    logprobs = join_completion_logprobs(echo_logprobs_body, logprobs)
            text: str | None = (spec.echo or "") + "".join(choice.texts)
            finish_reason, tool_calls = choice.finish_reason, None
            if spec.tools is not None:  # each choice's text becomes its content and tool_calls
                text, tool_calls = spec.tools.parser().parse(text or "")
                finish_reason = _tool_finish_reason(finish_reason, bool(tool_calls))
            bodies.append(choice_body(
                spec.header, index=index, text=text, tool_calls=tool_calls, finish_reason=finish_reason,
                stop_reason=choice.stop_reason, logprobs=logprobs,
                token_ids=choice.token_ids if spec.return_token_ids else None))
        prompt_logprobs = vllm_prompt_logprobs(prompt_entries, spec.tokenizer) if spec.prompt_logprobs else None
        prompt_ids = list(spec.prompt_token_ids) if spec.return_token_ids else None
        return choices_response_body(spec.header, bodies, usage, prompt_logprobs, prompt_token_ids=prompt_ids)
    finally:
        stream.close()


async def sse_events(stream: ResumableStream, spec: OutputSpec) -> AsyncIterator[str]:
    """The SSE body of a streaming request: `stream_bodies`' bodies, then [DONE]. The caller must also `close()`
    the stream if this generator is never iterated (see app.py's response class)."""
    async for body in stream_bodies(stream, spec):
        yield sse_event(body)
    yield SSE_DONE


async def stream_bodies(stream: ResumableStream, spec: OutputSpec) -> AsyncIterator[dict[str, Any]]:
    """The bodies of a streaming request's events, in order: its chunks, the usage chunk (include_usage), or an
    error's body (`{"error": ...}`, last). n > 1: each chunk names its choice's `index`; an echoed prompt opens
    each choice's first chunk. Closes `stream` when it ends."""
    header = spec.header
    # return_token_ids: the token ids no chunk of a choice carried yet; the choices whose first chunk, which carries
    # the prompt's ids, is still to come (chat: the body's first chunk carries them, once)
    pending_ids: dict[int, list[int]] = {}
    awaiting_prompt_ids = set(range(1 if header.chat else spec.num_choices)) if spec.return_token_ids else set()

    def chunk(index: int, **fields: Any) -> dict[str, Any]:
        """Choice `index`'s chunk with `fields`, the token ids it carries and, on its first, the prompt's
        (return_token_ids), and the usage so far (continuous_usage_stats)."""
        if index in awaiting_prompt_ids:
            awaiting_prompt_ids.discard(index)
            fields["prompt_token_ids"] = list(spec.prompt_token_ids)
        return chunk_body(header, index=index, include_usage=spec.include_usage,
                          usage=_usage(stream) if spec.continuous_usage else None,
                          token_ids=pending_ids.pop(index, []) if spec.return_token_ids else None, **fields)

    try:
        if header.chat:
            for index in range(spec.num_choices):
                yield chunk(index, text=None, role=True)
        text_offsets: dict[int, int] = {}  # per choice; a choice not in it has not had a chunk yet
        prompt_entries: list[serving_pb2.TokenLogprobs] = []
        num_left = spec.num_choices
        # chat with tools: per choice, its text becoming content and tool-call deltas
        parsers: dict[int, ToolCallParser] = {}
        while num_left:
            try:
                message = await _next(stream)
            except ApiError as error:
                yield error.body()
                break
            if message.prompt_logprobs and not prompt_entries:
                prompt_entries = list(message.prompt_logprobs)
            index = message.index
            text = message.text_delta
            logprobs = None
            echo_body = None
            pending_ids.setdefault(index, []).extend(message.token_ids)
            if index not in text_offsets:
                text_offsets[index] = 0
                if spec.echo is not None:
                    text = spec.echo + text
                    if spec.num_logprobs is not None and not header.chat:  # a completion's prompt logprobs
                        echo_body, text_offsets[index] = echo_logprobs(spec.prompt_token_ids, prompt_entries,
                                                                       spec.token_names)
            if spec.num_logprobs is not None and message.logprobs:
                logprobs, text_offsets[index] = _logprobs(message.logprobs, spec, text_offsets[index])
            if echo_body is not None:
                logprobs = echo_body if logprobs is None else join_completion_logprobs(echo_body, logprobs)
            finish_reason = message.finish_reason or None
            if spec.tools is not None and index not in parsers:
                parsers[index] = spec.tools.parser()
            parser = parsers.get(index)
            if parser is not None:  # the text becomes content and tool-call deltas
                for piece in parser.feed(text) + (parser.finish() if finish_reason else []):
                    yield chunk(index, text=piece.get("content"), tool_calls=piece.get("tool_calls"))
                if finish_reason is not None:
                    finish_reason = _tool_finish_reason(finish_reason, bool(parser.calls))
                if logprobs is not None or finish_reason is not None:
                    yield chunk(index, text=None, finish_reason=finish_reason, logprobs=logprobs)
            elif text or logprobs is not None or finish_reason is not None:
                yield chunk(index, text=text, finish_reason=finish_reason, stop_reason=openai_stop_reason(message),
                            logprobs=logprobs)
            if finish_reason is not None:
                num_left -= 1
                if not num_left and spec.include_usage:
                    yield usage_chunk_body(header, _usage(stream))
    finally:
        stream.close()


def _tool_finish_reason(finish_reason: str, has_calls: bool) -> str:
    """OpenAI's "tool_calls" when the output ended by itself with calls in it."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


async def _next(stream: ResumableStream) -> serving_pb2.GenerateResponse:
    """The next message of a live request; ApiError for a failed call, an error message or a cut stream."""
    try:
        message = await stream.read()
    except grpc.aio.AioRpcError as error:
        raise api_error_from_rpc(error)[0] from error
    if message is None:
        raise ApiError(status_code=500, message="the worker ended the stream without a finish reason")
    failure = message_failure(message)
    if failure is not None:
        raise failure
    return message


def _logprobs(
    entries: list[serving_pb2.TokenLogprobs] | Any, spec: OutputSpec, text_offset: int
) -> tuple[dict[str, Any], int]:
    if spec.header.chat:
        return chat_logprobs(entries, spec.token_names), text_offset
    return completion_logprobs(entries, spec.token_names, text_offset=text_offset)


def _usage(stream: ResumableStream) -> Usage:
    return Usage(prompt_tokens=stream.num_prompt_tokens, completion_tokens=stream.num_completion_tokens,
                 cached_tokens=stream.num_cached_tokens)
