"""A burst of concurrent streamed completions against a running gateway, for the overload tests: every request's
HTTP status, whether its stream ended properly, and when it got its first token."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, kw_only=True)
class Outcome:
    status: int  # HTTP status; 0: the connection failed
    completed: bool  # a 200 whose stream ended with a finish_reason and [DONE]
    num_tokens: int  # from the usage of the stream's last chunk
    ttft_s: float | None  # arrival -> first text chunk
    error: str = ""


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started_s = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Outcome(status=response.status_code, completed=False, num_tokens=0, ttft_s=None,
                               error=(await response.aread()).decode(errors="replace")[:300])
            ttft_s, num_tokens, finished, done = None, 0, False, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(status=200, completed=False, num_tokens=num_tokens, ttft_s=ttft_s,
                                   error=str(chunk["error"])[:300])
                if chunk.get("usage"):  # the last chunk: the tokens generated, however the text was chunked
                    num_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                choice = chunk["choices"][0]
                if choice.get("text") and ttft_s is None:
                    ttft_s = time.perf_counter() - started_s
                finished = finished or choice.get("finish_reason") is not None
            return Outcome(status=200, completed=finished and done, num_tokens=num_tokens, ttft_s=ttft_s)
    except httpx.HTTPError as exc:
        return Outcome(status=0, completed=False, num_tokens=0, ttft_s=None, error=repr(exc)[:300])


async def _burst(url: str, model: str, num_requests: int, max_tokens: int, timeout_s: float) -> list[Outcome]:
    limits = httpx.Limits(max_connections=num_requests + 10, max_keepalive_connections=num_requests + 10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        return list(await asyncio.gather(*(
            _one(client, model, f"Request {i}: count from one to ten.", max_tokens) for i in range(num_requests))))


def burst(url: str, model: str, *, num_requests: int, max_tokens: int = 16, timeout_s: float = 300.0) -> list[Outcome]:
    """`num_requests` streamed completions sent at once; their outcomes in request order."""
    return asyncio.run(_burst(url, model, num_requests, max_tokens, timeout_s))
