"""Load against a running gateway: a burst of concurrent streamed completions (the overload tests), a steady load
of a few clients that keep sending until stopped (the scaling tests, bench/chaos.py), and one greedy stream read
chunk by chunk (the migration tests). Every request's HTTP status, whether its stream ended properly, when it got
its first token, its prompt and text (so that a caller can check the answer), and whether it hung past a deadline.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, kw_only=True)
class Outcome:
    status: int  # HTTP status; 0: the connection failed
    completed: bool  # a 200 whose stream ended with a finish_reason and [DONE]
    num_tokens: int  # from the usage of the stream's last chunk
    ttft_s: float | None  # arrival -> first text chunk
    error: str = ""
    retry_after: str | None = None  # the Retry-After header of a response that was not a 200
    elapsed_s: float = 0.0  # sent -> response and stream read to their end
    prompt: str = ""
    text: str = ""  # the streamed text, every chunk's
    hung: bool = False  # still not ended at the caller's deadline (SteadyLoad's deadline_s): given up on


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started_s = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                error = (await response.aread()).decode(errors="replace")[:300]
                return Outcome(status=response.status_code, completed=False, num_tokens=0, ttft_s=None, error=error,
                               retry_after=response.headers.get("retry-after"),
                               elapsed_s=time.perf_counter() - started_s, prompt=prompt)
            ttft_s, num_tokens, finished, done, text = None, 0, False, False, ""
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
                                   error=str(chunk["error"])[:300], prompt=prompt, text=text)
                if chunk.get("usage"):  # the last chunk: the tokens generated, however the text was chunked
                    num_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                choice = chunk["choices"][0]
                if choice.get("text") and ttft_s is None:
                    ttft_s = time.perf_counter() - started_s
                text += choice.get("text") or ""
                finished = finished or choice.get("finish_reason") is not None
            return Outcome(status=200, completed=finished and done, num_tokens=num_tokens, ttft_s=ttft_s,
                           elapsed_s=time.perf_counter() - started_s, prompt=prompt, text=text)
    except httpx.HTTPError as exc:
        return Outcome(status=0, completed=False, num_tokens=0, ttft_s=None, error=repr(exc)[:300], prompt=prompt)


async def _within(deadline_s: float | None, client: httpx.AsyncClient, model: str, prompt: str,
                  max_tokens: int) -> Outcome:
    """`_one`, given up on (an Outcome with `hung`) when it has not ended `deadline_s` after it was sent."""
    if deadline_s is None:
        return await _one(client, model, prompt, max_tokens)
    try:
        return await asyncio.wait_for(_one(client, model, prompt, max_tokens), deadline_s)
    except TimeoutError:
        return Outcome(status=0, completed=False, num_tokens=0, ttft_s=None, error=f"not ended in {deadline_s} s",
                       prompt=prompt, hung=True, elapsed_s=deadline_s)


async def _burst(url: str, model: str, num_requests: int, max_tokens: int, timeout_s: float) -> list[Outcome]:
    limits = httpx.Limits(max_connections=num_requests + 10, max_keepalive_connections=num_requests + 10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        return list(await asyncio.gather(*(
            _one(client, model, f"Request {i}: count from one to ten.", max_tokens) for i in range(num_requests))))


def burst(url: str, model: str, *, num_requests: int, max_tokens: int = 16, timeout_s: float = 300.0) -> list[Outcome]:
    """`num_requests` streamed completions sent at once; their outcomes in request order."""
    return asyncio.run(_burst(url, model, num_requests, max_tokens, timeout_s))


class SteadyLoad:
    """`num_clients` clients, each sending streamed greedy completions one after another until `stop()`, on a
    thread of its own. Each client's prompts are `prompt(client, n)` (the scaling tests' share no prefix).
    `deadline_s`: a request not ended that long after it was sent is given up on and counted `hung`. `headers`:
    sent with every request (an API key's Authorization)."""

    def __init__(self, url: str, model: str, *, num_clients: int, max_tokens: int,
                 prompt: Callable[[int, int], str], timeout_s: float = 120.0,
                 deadline_s: float | None = None, headers: dict[str, str] | None = None) -> None:
        self._url, self._model, self._num_clients = url, model, num_clients
        self._headers = headers or {}
        self._max_tokens, self._prompt, self._timeout_s = max_tokens, prompt, timeout_s
        self._deadline_s = deadline_s
        self.outcomes: list[Outcome] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="steady-load", daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        """Let every client finish its current request; every outcome so far."""
        self._stopping.set()
        self._thread.join(max(self._timeout_s, self._deadline_s or 0) + 10)
        assert not self._thread.is_alive(), "the load's clients did not finish"
        return list(self.outcomes)

    def wait_for(self, num_outcomes: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < num_outcomes:
            assert time.monotonic() < deadline, f"only {len(self.outcomes)} requests finished in {timeout_s} s"
            time.sleep(0.05)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self._num_clients + 2)
        async with httpx.AsyncClient(base_url=self._url, timeout=self._timeout_s, limits=limits,
                                     headers=self._headers) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self._num_clients)))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        n = 0
        while not self._stopping.is_set():
            self.outcomes.append(await _within(self._deadline_s, client, self._model, self._prompt(index, n),
                                               self._max_tokens))
            n += 1


@dataclass
class GreedyStream:
    """One streamed greedy completion as the client saw it."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)  # from logprobs: one per generated token
    usage: dict = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)  # error events
    finish_reasons: list[str] = field(default_factory=list)


def stream_greedy(url: str, model: str, prompt: str, *, max_tokens: int,
                  on_chunk: Callable[[int], None] | None = None) -> GreedyStream:
    """Stream one greedy completion (ignore_eos, logprobs); `on_chunk(n)` after the n-th text chunk was read."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    result = GreedyStream()
    num_chunks = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[len("data: "):])
            if payload.get("usage"):
                result.usage = payload["usage"]
            if "error" in payload:
                result.errors.append(payload)
            if not payload.get("choices"):
                continue
            choice = payload["choices"][0]
            result.text += choice["text"]
            if choice["logprobs"]:
                result.tokens += choice["logprobs"]["tokens"]
            if choice["finish_reason"]:
                result.finish_reasons.append(choice["finish_reason"])
            num_chunks += 1
            if on_chunk is not None:
                on_chunk(num_chunks)
    return result
