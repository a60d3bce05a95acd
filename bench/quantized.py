"""`--quantization` end to end (issue 34's benchmark, first part): single-stream decode tok/s and resident weight
bytes of the SmolLM2 Q4_1 GGUF with `none`, `int8` and `gguf`, every configuration in one run, interleaved round by
round (the machine is shared: each configuration's best round is reported).

    .venv/bin/python bench/quantized.py [--threads 2] [--tokens 64] [--rounds 3] [--json out.json]

Decode tok/s is 1 / the request's mean time per output token after the first (RequestStats.tpot_s): prefill is not
in it. `--llama-cpp` times llama.cpp (llama-cpp-python, not a dependency: install it yourself, e.g. as
docs/benchmarks.md's "Single-stream decode vs llama.cpp" says) on the same GGUF file in the same rounds: greedy,
the same prompt, the time per token after the first, its own Q4_1/Q8_0 kernels on the same thread count. `--streams N` (e.g. 32) also times aggregate
decode: N distinct short prompts at once through each engine, output tokens / wall time of the batch (prefill of
the short prompts included), best round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.distributed.rank_worker import model_weight_bytes  # noqa: E402
from engine.llm import LLM  # noqa: E402

METHODS = ("none", "int8", "gguf")
PROMPT = "Once upon a time, in a small village by the sea,"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp on the same GGUF, same rounds")
    parser.add_argument("--streams", type=int, default=0, help="also aggregate decode of this many streams at once")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {m: LLM(args.model, quantization=m, device="cpu", dtype="float32", num_threads=args.threads,
                   max_model_len=1024, num_kv_blocks=128, enable_prefix_caching=False) for m in METHODS}
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():  # warm-up: kernels loaded, first-call costs paid
        llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    cpp = llama_cpp_decoder(args) if args.llama_cpp else None
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for method, llm in llms.items():
            stats = llm.generate(PROMPT, params)[0].stats
            assert stats is not None and stats.tpot_s > 0
            best[method] = max(best.get(method, 0.0), 1 / stats.tpot_s)
            print(f"round {r} {method:5s} {1 / stats.tpot_s:7.1f} tok/s", flush=True)
        if cpp is not None:
            tok_s = cpp(args.tokens)
            best["llama.cpp"] = max(best.get("llama.cpp", 0.0), tok_s)
            print(f"round {r} llama.cpp {tok_s:7.1f} tok/s", flush=True)
    aggregate: dict[str, float] = {}
    if args.streams:
        prompts = [f"{PROMPT} story number {i}:" for i in range(args.streams)]
        for r in range(args.rounds):
            for method, llm in llms.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                tok_s = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
                aggregate[method] = max(aggregate.get(method, 0.0), tok_s)
                print(f"round {r} {method:5s} {args.streams} streams {tok_s:7.1f} tok/s", flush=True)
    results = {}
    for method, llm in llms.items():
        weight_bytes = model_weight_bytes(llm.engine.runner.model)
        results[method] = {"decode_tok_s": best[method], "weight_bytes": weight_bytes,
                           "vs_none": best[method] / best["none"]}
        print(f"{method:5s} single-stream decode {best[method]:7.1f} tok/s ({best[method] / best['none']:.2f}x none), "
              f"weights {weight_bytes / 2**20:7.1f} MiB")
        if method in aggregate:
            results[method] |= {"aggregate_tok_s": aggregate[method], "aggregate_vs_none": aggregate[method] /
                                aggregate["none"], "streams": args.streams}
            print(f"{method:5s} {args.streams} streams {aggregate[method]:7.1f} tok/s "
                  f"({aggregate[method] / aggregate['none']:.2f}x none)")
    if cpp is not None:
        results["llama.cpp"] = {"decode_tok_s": best["llama.cpp"]}
        for method in METHODS:
            print(f"{method:5s} / llama.cpp: {best[method] / best['llama.cpp']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "tokens": args.tokens, "results": results}, f, indent=2)


def llama_cpp_decoder(args: argparse.Namespace):  # noqa: ANN201 - (tokens) -> tok/s
    """llama.cpp over the same GGUF file: a function that decodes `tokens` greedy tokens after PROMPT and returns
    tok/s over the tokens after the first (as RequestStats.tpot_s counts ours)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("--llama-cpp needs llama-cpp-python (not a splitserve dependency; see this file's docstring)")
    from engine.loader.model_registry import resolve_model

    llm = Llama(model_path=str(resolve_model(args.model)), n_ctx=1024, n_threads=args.threads, verbose=False)
    prompt_ids = llm.tokenize(PROMPT.encode())

    def decode(tokens: int) -> float:
        llm.reset()
        llm.eval(prompt_ids)
        llm.eval([llm.sample(temp=0.0)])  # the first token, as ours: not timed
        start = time.perf_counter()
        for _ in range(tokens - 1):
            llm.eval([llm.sample(temp=0.0)])
        return (tokens - 1) / (time.perf_counter() - start)

    decode(4)  # warm-up
    return decode


if __name__ == "__main__":
    main()
