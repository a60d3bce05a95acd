"""Turning an open ResumableStream into the client's answer: one JSON body, or Server-Sent Events.

    SSE:  [chat: role chunk] ─ one chunk per worker message that carries text, logprobs or a finish_reason ─
          [usage chunk, when stream_options.include_usage] ─ "data: [DONE]"

A failure after the first byte cannot change the HTTP status any more, so it becomes an error event in OpenAI's
shape, `data: {"error": {...}}`, followed by `data: [DONE]`. Both paths close the stream whatever happens,
which cancels and aborts the request on the worker unless it finished. A decode worker lost mid-stream is
replaced under the stream (router/resumable_stream.py); only a request that cannot be resumed ends in an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc.aio

from protos import serving_pb2
from router.dispatcher import api_error_from_rpc, message_failure
from router.errors import ApiError
from router.resumable_stream import ResumableStream
from router.responses import (
    SSE_DONE,
    ResponseHeader,
    Usage,
    chat_logprobs,
    chunk_body,
    completion_logprobs,
    openai_stop_reason,
    response_body,
    sse_event,
    usage_chunk_body,
)

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer
    from router.tools import ToolPlan


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """How one request wants its output written."""

    header: ResponseHeader
    tokenizer: Tokenizer
    num_logprobs: int | None  # None: no logprobs
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    include_usage: bool = False
    tools: ToolPlan | None = None  # chat with tools: the output becomes content and tool_calls (router/tools.py)


async def collect_response(stream: ResumableStream, spec: OutputSpec) -> dict[str, Any]:
    """Read `stream` to its end and build the non-streaming body. ApiError when the request failed."""
    try:
        texts: list[str] = []
        entries: list[serving_pb2.TokenLogprobs] = []
        while True:
            message = await _next(stream)
            texts.append(message.text_delta)
            entries.extend(message.logprobs)
            if message.finish_reason:
                break
        text: str | None = "".join(texts)
        finish_reason = message.finish_reason
        tool_calls = None
        if spec.tools is not None:
            text, tool_calls = spec.tools.parser().parse(text or "")
            finish_reason = _tool_finish_reason(finish_reason, bool(tool_calls))
        return response_body(
            spec.header,
            text=text,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            stop_reason=openai_stop_reason(message.finish_reason, message.stop_reason, spec.stop,
                                           spec.stop_token_ids),
            logprobs=_logprobs(entries, spec, 0)[0] if spec.num_logprobs is not None else None,
            usage=_usage(stream),
        )
    finally:
        stream.close()


async def sse_events(stream: ResumableStream, spec: OutputSpec) -> AsyncIterator[str]:
    """The SSE body of a streaming request. The caller must also `close()` the stream if this generator is
    never iterated (see app.py's response class)."""
    header = spec.header
    try:
        if header.chat:
            yield sse_event(chunk_body(header, text=None, role=True, include_usage=spec.include_usage))
        text_offset = 0
        parser = spec.tools.parser() if spec.tools is not None else None
        while True:
            try:
                message = await _next(stream)
            except ApiError as error:
                yield sse_event(error.body())
                break
            logprobs = None
            if spec.num_logprobs is not None and message.logprobs:
                logprobs, text_offset = _logprobs(message.logprobs, spec, text_offset)
            finish_reason = message.finish_reason or None
            if parser is not None:  # the text becomes content and tool-call deltas
                for piece in parser.feed(message.text_delta) + (parser.finish() if finish_reason else []):
                    yield sse_event(chunk_body(header, text=piece.get("content"), tool_calls=piece.get("tool_calls"),
                                               include_usage=spec.include_usage))
                if finish_reason is not None:
                    finish_reason = _tool_finish_reason(finish_reason, bool(parser.calls))
                if logprobs is not None or finish_reason is not None:
                    yield sse_event(chunk_body(header, text=None, finish_reason=finish_reason, logprobs=logprobs,
                                               include_usage=spec.include_usage))
            elif message.text_delta or logprobs is not None or finish_reason is not None:
                stop_reason = openai_stop_reason(message.finish_reason, message.stop_reason, spec.stop,
                                                 spec.stop_token_ids)
                yield sse_event(chunk_body(header, text=message.text_delta, finish_reason=finish_reason,
                                           stop_reason=stop_reason, logprobs=logprobs,
                                           include_usage=spec.include_usage))
            if finish_reason is not None:
                if spec.include_usage:
                    yield sse_event(usage_chunk_body(header, _usage(stream)))
                break
        yield SSE_DONE
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
        return chat_logprobs(entries, spec.tokenizer), text_offset
    return completion_logprobs(entries, spec.tokenizer, text_offset=text_offset)


def _usage(stream: ResumableStream) -> Usage:
    return Usage(prompt_tokens=stream.num_prompt_tokens, completion_tokens=stream.num_completion_tokens,
                 cached_tokens=stream.num_cached_tokens)
