"""A batch of prompts in one `/v1/completions` request: OpenAI's and vLLM's `prompt` as a list of texts or of
token-id lists (what lm-evaluation-harness's `local-completions` and many batch clients send).

Each prompt is a request of its own to the workers: its own admission, routing, prefix lookup and KV handoff, so
the batch spreads over the pools as separate requests would. They answer as one response, in vLLM's layout:

    prompts  p0 p1 p2, n = 2      choices  0 1 | 2 3 | 4 5      prompt i's choice j at index i * n + j

with the usage summed over the prompts and the first prompt's response id. Streamed, the prompts' chunks are
interleaved as they come, each naming its choice's index, then one usage chunk (stream_options.include_usage) and
one [DONE]. With `continuous_usage_stats`, a chunk's usage is its own prompt's so far. The first error (a prompt
that failed) is the answer: a non-streaming batch is that error, a stream ends with its error event; the other
prompts' requests are then cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from router.protocol import CompletionRequest
from router.responses import SSE_DONE, Usage, sse_event

T = TypeVar("T")


def batch_prompts(request: CompletionRequest) -> list[str] | list[list[int]] | None:
    """The prompts of a batch of two or more; None for one prompt (a batch of one is one prompt)."""
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
        return prompt  # type: ignore[return-value]
    return None


class StreamGroup:
    """The open streams of a batch, closed together."""

    def __init__(self, streams: Sequence[Any]) -> None:
        self.streams = list(streams)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def merge_bodies(bodies: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """One non-streaming completion body from each prompt's, in prompt order."""
    choices = [{**choice, "index": i * n + choice["index"]} for i, body in enumerate(bodies)
               for choice in body["choices"]]
    return {**bodies[0], "choices": choices, "usage": sum_usage([body["usage"] for body in bodies])}


def sum_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The prompts' usage bodies (router/responses.py's `Usage.body()`) summed into one."""
    return Usage(prompt_tokens=sum(usage["prompt_tokens"] for usage in usages),
                 completion_tokens=sum(usage["completion_tokens"] for usage in usages),
                 cached_tokens=sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in usages)).body()


async def merged_events(streams: Sequence[AsyncIterator[dict[str, Any]]], n: int,
                        response_id: str) -> AsyncIterator[str]:
    """The SSE body of a streamed batch from each prompt's stream bodies (router/streaming.py's `stream_bodies`),
    in prompt order: chunks re-indexed and under `response_id` as they come, the usage chunks held and summed into
    one at the end, the first error body ending it."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for body in stream:
                queue.put_nowait((index, body))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    usage_chunks: list[dict[str, Any]] = []
    try:
        num_live = len(tasks)
        while num_live:
            index, body = await queue.get()
            if body is None:
                num_live -= 1
                continue
            if isinstance(body, BaseException):
                raise body
            if "error" in body:
                yield sse_event(body)
                break
            if not body["choices"] and body.get("usage") is not None:  # a prompt's last chunk: its usage
                usage_chunks.append(body)
                continue
            for choice in body["choices"]:
                choice["index"] += index * n
            yield sse_event({**body, "id": response_id})
        else:
            if usage_chunks:  # include_usage: every prompt sent one
                usage = sum_usage([chunk["usage"] for chunk in usage_chunks])
                yield sse_event({**usage_chunks[0], "id": response_id, "usage": usage})
        yield SSE_DONE
    finally:  # the other prompts' readers stop before their streams close (a closed stream being read resumes)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather_or_cancel(*works: Awaitable[T]) -> list[T]:
    """`asyncio.gather`, except that the first failure cancels the others, and waits for them, before it is
    raised: a prompt's request that failed ends the batch's other requests."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
