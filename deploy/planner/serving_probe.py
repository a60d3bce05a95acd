"""What a real `splitserve serve` adds to the engine's own times, for the profile: one colocated worker with the
profiled engine flags, a light client (this process, httpx) sending one streamed request at a time. Torch-free.

    measure_serving(serve_args, prefill_s, decode_step_s, num_requests) -> Serving

    ttft_overhead_s            the least of `num_requests` max_tokens-1 requests' TTFT - prefill_s(its prompt tokens)
    step_overhead_s            the least of `num_requests` max_tokens-M requests' mean inter-token time
                               -  decode_step_s(1, ctx)
    gateway_cpu_per_request_s  the gateway process's CPU (utime + stime, /proc) over the max_tokens-1 requests, each
    gateway_cpu_per_token_s    its CPU over the max_tokens-M requests beyond that, per token after the first

The gateway runs in `serve`'s own process (the router's uvicorn thread): its CPU is what `plan --one-host` takes from
the workers' cores per request and per token. Prompts are random words (fresh each request: no prefix-cache hit),
their token count read from the gateway's usage. Each overhead is the fastest request's, as the engine's profile
keeps each point's fastest (a median set against those minimums counted the host's noise as serving: two profiles
measured a step overhead of 8.5 and 4.2 ms that way). Overheads are floored at 0: a served request can come out
faster than the engine's fit.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from deploy.planner.profile import Serving
from deploy.process_group import interrupt_group

REPO_ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this have not but had "
         "they you were time day year people way man world life hand part child eye woman place work week case point "
         "number group problem fact house water river light stone city").split()


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used, from /proc (Linux); 0 where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: the 14th and 15th fields


class ServeProcess:
    """`python -m deploy.cli serve --port 0 <args>` in its own process group until `stop()`; `url` once serving."""

    def __init__(self, args: Sequence[str], *, timeout_s: float = 300.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            if line.startswith("splitserve: serving"):
                self.url = line.split(" on ")[1].split()[0]
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(f"splitserve serve {' '.join(args)} did not start")

    def stop(self) -> None:
        interrupt_group(self.proc)


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, the arrival times of its tokens, its prompt tokens) of one streamed completion."""
    import httpx

    started = time.perf_counter()
    arrivals: list[float] = []
    prompt_tokens = 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if chunk.get("usage"):
                prompt_tokens = int(chunk["usage"]["prompt_tokens"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("a served request streamed no token")
    return arrivals[0] - started, arrivals, prompt_tokens


def measure_serving(serve_args: Sequence[str], *, model: str, prompt_words: int, prefill_s: Callable[[int], float],
                    decode_step_s: Callable[[int], float], num_requests: int = 6, max_tokens: int = 32,
                    seed: int = 0) -> Serving:
    """Serve `serve_args` (one colocated worker), measure (see the module docstring), stop it. `prefill_s(n)`: the
    profile's prefill of n tokens; `decode_step_s(ctx)`: its decode step of one sequence at ctx tokens."""
    rng = random.Random(seed)

    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(prompt_words))

    server = ServeProcess(serve_args)
    try:
        pid = server.proc.pid
        _stream(server.url, model, prompt(), 4)  # warm: the first request pays one-time costs
        cpu0 = process_cpu_s(pid)
        firsts = [_stream(server.url, model, prompt(), 1) for _ in range(num_requests)]
        cpu1 = process_cpu_s(pid)
        longs = [_stream(server.url, model, prompt(), max_tokens) for _ in range(num_requests)]
        cpu2 = process_cpu_s(pid)
    finally:
        server.stop()
    prompt_tokens = int(statistics.median(n for _, _, n in firsts)) or prompt_words
    ttft_overhead = min(ttft - prefill_s(n or prompt_words) for ttft, _, n in firsts)
    gaps = [(arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) for _, arrivals, _ in longs if len(arrivals) > 1]
    step_overhead = min(gaps) - decode_step_s(prompt_tokens + max_tokens // 2) if gaps else 0.0
    per_request = (cpu1 - cpu0) / num_requests
    num_tokens = sum(len(arrivals) for _, arrivals, _ in longs)
    per_token = max(0.0, (cpu2 - cpu1) - per_request * num_requests) / max(1, num_tokens - num_requests)
    return Serving(num_requests=num_requests, prompt_tokens=prompt_tokens, ttft_overhead_s=max(0.0, ttft_overhead),
                   step_overhead_s=max(0.0, step_overhead), gateway_cpu_per_request_s=per_request,
                   gateway_cpu_per_token_s=per_token)
