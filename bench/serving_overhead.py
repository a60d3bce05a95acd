"""Single-stream decode through `splitserve serve` against the offline engine, same machine, same run.

    python bench/serving_overhead.py [--rounds 5] [--max-tokens 128] [--modes offline,colocated,disaggregated]

One greedy request at a time: a ~100-token prompt, `--max-tokens` generated tokens (ignore_eos). Offline, the
engine runs in this process (`LLMEngine.step()` until done); through `serve`, a real `splitserve serve`
subprocess (Ray, the gateway, the workers) answers a streamed /v1/completions. Tokens per second of one stream
is (tokens - 1) / (last token - first token): decode only, on both sides (TTFT is reported apart). Rounds
alternate between the configurations so that the machine's drift tilts neither; each `serve` stays up for the
whole run and is idle while another configuration is measured.

The ratio printed is serve's median tokens/s over the offline engine's; issue 15's target is >= 0.90.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve_process import Serve as ServeProcess  # noqa: E402

PROMPT = ("The history of the lighthouse begins in the ancient world, where fires were lit on hilltops to guide "
          "ships home. Over the centuries, these simple beacons became towers of stone and glass, and their "
          "keepers lived lonely lives by the sea. Write a short story about one such keeper, the storms he saw, "
          "and the ship he saved on the last night of his service.")


def offline_round(engine, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:  # noqa: ANN001
    """(TTFT, decode tokens/s) of one request on the in-process engine, stepping as a worker's loop does."""
    from engine.request.sampling_params import SamplingParams

    start_s = time.perf_counter()
    engine.add_request(f"o{time.monotonic_ns()}", prompt_ids,
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    first_s = last_s = None
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            num_tokens = len(out.token_ids)
            if first_s is None:
                first_s = now
            last_s = now
    assert first_s is not None and last_s is not None and num_tokens == max_tokens
    return first_s - start_s, (num_tokens - 1) / (last_s - first_s)


class Serve(ServeProcess):
    """`splitserve serve` as a subprocess, up until `stop()`; one streamed request per round."""

    def round(self, model: str, max_tokens: int) -> tuple[float, float]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        start_s = time.perf_counter()
        first_s = last_s = None
        num_tokens = 0
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if json.loads(line[6:])["choices"][0]["text"]:
                    now = time.perf_counter()
                    num_tokens += 1
                    first_s = first_s or now
                    last_s = now
        assert first_s is not None and last_s is not None
        # A chunk can carry more than one token (the detokenizer holds back partial characters): count tokens from
        # the usage the server reports instead of chunks.
        return first_s - start_s, (max_tokens - 1) / (last_s - first_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--modes", default="offline,colocated,disaggregated")
    args = parser.parse_args()
    modes = args.modes.split(",")

    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader.model_registry import resolve_model

    model = str(resolve_model("smollm2-135m"))
    servers: dict[str, Serve] = {}
    if "colocated" in modes:
        servers["colocated"] = Serve(["--colocated"], model=model)
    if "disaggregated" in modes:
        servers["disaggregated"] = Serve(["--prefill-workers", "1", "--decode-workers", "1"], model=model)
    engine = LLMEngine(EngineConfig(model=model, num_threads=len(os.sched_getaffinity(0))))
    prompt_ids = engine.tokenizer.encode(PROMPT)
    print(f"prompt {len(prompt_ids)} tokens, {args.max_tokens} generated, {torch.get_num_threads()} threads offline")
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    try:
        for mode, server in servers.items():  # warm-up: first requests pay one-off costs everywhere
            server.round(model, 8)
        offline_round(engine, prompt_ids, 8)
        for _ in range(args.rounds):
            for mode in modes:
                if mode == "offline":
                    results[mode].append(offline_round(engine, prompt_ids, args.max_tokens))
                else:
                    results[mode].append(servers[mode].round(model, args.max_tokens))
    finally:
        for server in servers.values():
            server.stop()
    base = statistics.median(tps for _, tps in results["offline"]) if "offline" in results else None
    print(f"{'mode':14} {'TTFT p50 (ms)':>14} {'decode tok/s p50':>17} {'all rounds':>30} {'vs offline':>11}")
    for mode, rounds in results.items():
        tps = [t for _, t in rounds]
        median = statistics.median(tps)
        ratio = f"{median / base:.3f}" if base else "-"
        print(f"{mode:14} {1000 * statistics.median(t for t, _ in rounds):14.1f} {median:17.1f} "
              f"{' '.join(f'{t:.1f}' for t in tps):>30} {ratio:>11}")


if __name__ == "__main__":
    main()
