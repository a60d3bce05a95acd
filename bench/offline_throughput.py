"""Offline throughput: splitserve's engine vs HF transformers `generate`, same weights, dtype and run.

Workload: N prompts (default 200) of real text, input lengths uniform in [32, 1024] tokens, output lengths
uniform in [16, 256] (EOS ignored, so both sides produce exactly the requested tokens). HF runs static batches
in input order, left-padded, each batch decoding to its longest request; it is timed at its best batch size,
chosen by a calibration pass over the first `--calibration-prompts` prompts at each of --hf-batch-sizes.
Output tokens/s counts only the requested tokens on both sides. splitserve runs once before HF and once after it,
and the ratio takes the mean of its two times, so that the machine's drift over the ~30-minute run tilts neither side
(each single ratio is printed too).

Optionally (--llama-cpp) also times single-stream decode against llama.cpp (llama-cpp-python) on the same GGUF.

    .venv/bin/python bench/offline_throughput.py                  # the full run recorded in docs/benchmarks.md
    .venv/bin/python bench/offline_throughput.py --num-prompts 24 --hf-batch-sizes 8   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from tests.engine.prompts import long_prompt  # noqa: E402


def make_workload(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    corpus = tokenizer.encode(long_prompt(min_words=6000), add_special_tokens=False)
    work = []
    for _ in range(n):
        in_len, out_len = rng.randint(32, 1024), rng.randint(16, 256)
        start = rng.randrange(0, len(corpus) - in_len)
        work.append((corpus[start : start + in_len], out_len))
    return work


def run_ours(checkpoint, work, args) -> float:
    engine = LLMEngine(
        EngineConfig(
            dtype=args.dtype,
            max_model_len=2048,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=int(args.kv_cache_memory_gib * (1 << 30)),
            enable_prefix_caching=True,
        ),
        checkpoint=checkpoint,
    )
    start = time.perf_counter()
    for i, (ids, out_len) in enumerate(work):
        engine.add_request(f"b{i}", ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced += len(out.token_ids)
    elapsed = time.perf_counter() - start
    assert produced == sum(o for _, o in work)
    assert engine.stats().kv_blocks_used == 0
    return elapsed


@torch.inference_mode()
def run_hf(model, work, batch_size: int, pad_id: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(work), batch_size):
        batch = work[b : b + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, _) in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        max_new = max(o for _, o in batch)
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,  # EOS ignored, as on our side
            pad_token_id=pad_id,
        )
    return time.perf_counter() - start


def run_llama_cpp(gguf: str, checkpoint, args) -> None:
    from llama_cpp import Llama

    prompt = "Write a long story about a lighthouse keeper."
    n = args.single_stream_tokens
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)
    ids = llm.tokenize(prompt.encode())
    llm.eval(ids)
    start = time.perf_counter()
    for _ in range(n):
        token = llm.sample(temp=0.0)
        llm.eval([token])
    cpp_s = (time.perf_counter() - start) / n

    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_model_len=2048), checkpoint=checkpoint)
    engine.add_request("s", checkpoint.tokenizer.encode(prompt), SamplingParams(temperature=0.0, max_tokens=n + 1,
                                                                                 ignore_eos=True))
    engine.step()  # prefill + first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    ours_s = (time.perf_counter() - start) / n
    print(f"single-stream decode: llama.cpp (Q4_1 GGUF kernels) {1 / cpp_s:.1f} tok/s, "
          f"splitserve ({args.dtype}) {1 / ours_s:.1f} tok/s, ratio {cpp_s / ours_s:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hf-batch-sizes", default="1,8,32")
    p.add_argument("--calibration-prompts", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory-gib", type=float, default=6.0, help="room for the whole workload in flight")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--llama-cpp", action="store_true", help="also time single-stream decode vs llama.cpp")
    p.add_argument("--single-stream-tokens", type=int, default=128)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()

    gguf = str(resolve_model("smollm2-135m"))
    dtype = getattr(torch, args.dtype)
    checkpoint = load_checkpoint(gguf, dtype=dtype)
    work = make_workload(checkpoint.tokenizer, args.num_prompts, args.seed)
    total_out = sum(o for _, o in work)
    print(f"workload: {len(work)} prompts, {sum(len(i) for i, _ in work)} prompt tokens, {total_out} output "
          f"tokens; torch threads {torch.get_num_threads()}")

    ours_before = run_ours(checkpoint, work, args)
    gc.collect()  # the engine's KV cache, before HF's turn
    print(f"splitserve: {ours_before:.1f} s, {total_out / ours_before:.1f} output tok/s")

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        directory, name = os.path.split(gguf)
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()
        pad_id = checkpoint.tokenizer.eos_token_id
        sizes = [int(s) for s in args.hf_batch_sizes.split(",")]
        best = sizes[0]
        if len(sizes) > 1:
            calib = work[: args.calibration_prompts]
            calib_out = sum(o for _, o in calib)
            rates = {}
            for bs in sizes:
                rates[bs] = calib_out / run_hf(hf, calib, bs, pad_id)
                print(f"  HF calibration, batch {bs}: {rates[bs]:.1f} output tok/s on {len(calib)} prompts")
            best = max(rates, key=rates.__getitem__)
        hf_s = run_hf(hf, work, best, pad_id)
        print(f"HF transformers generate (batch {best}): {hf_s:.1f} s, {total_out / hf_s:.1f} output tok/s")
        del hf
        gc.collect()
        ours_after = run_ours(checkpoint, work, args)
        print(f"splitserve again, after HF: {ours_after:.1f} s, {total_out / ours_after:.1f} output tok/s")
        ours_s = (ours_before + ours_after) / 2
        print(f"ratio splitserve / HF: {hf_s / ours_s:.2f}x (mean of splitserve's two runs; "
              f"{hf_s / ours_before:.2f}x before HF, {hf_s / ours_after:.2f}x after)")

    if args.llama_cpp:
        run_llama_cpp(gguf, checkpoint, args)


if __name__ == "__main__":
    main()
