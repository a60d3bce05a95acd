"""A KV tier's load time per block against recomputing the block (issue 35's GPU figure; the disk tier on any device).

One engine (dummy weights of `--shape`, prefix caching on, a device KV cache of `--num-kv-blocks` blocks) with the
tier under test (`host`: `--kv-offload-memory`, cuda only; `disk`: `--kv-offload-dir`). Each round:

    cold     a fresh prompt of --prompt-tokens: every block computed (time to its first token)
    evict    other fresh prompts until the cold prompt's blocks have left the device cache (and reached the tier)
    return   the cold prompt again: its blocks loaded from the tier, the last partial one computed

and prints per round the cold and returning prefill (time to the first token, one request alone), the blocks the
tier loaded, and the tier's time a block (each `TierBlocks.load`, timed with the device synchronized around it)
against the cold prefill's time a block. Greedy tokens of the returning prompt are checked against the cold run's.

    PYTHONPATH=. python bench/kv_tier_load.py --device cuda --tier host [--shape smollm2-135m] [--rounds 5]
    PYTHONPATH=. python bench/kv_tier_load.py --device cpu --tier disk --shape smollm2-135m --prompt-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.device import TORCH_DTYPES  # noqa: E402
from engine.kv_tier_blocks import TierBlocks  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import Checkpoint  # noqa: E402
from engine.loader.dummy_weights import (  # noqa: E402
    byte_level_tokenizer,
    dummy_checkpoint_path,
    dummy_model_config,
    dummy_model_id,
    dummy_weights,
)

BLOCK_SIZE = 16
SEED = 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args: argparse.Namespace, device: torch.device, offload_dir: str) -> LLMEngine:
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    config = dummy_model_config(args.shape)
    tier = ({"kv_offload_memory_bytes": args.tier_mib << 20} if args.tier == "host"
            else {"kv_offload_dir": offload_dir, "kv_offload_size_bytes": args.tier_mib << 20})
    engine_config = EngineConfig(
        model=args.shape, device=str(device), dtype=dtype, load_format="dummy", block_size=BLOCK_SIZE,
        num_kv_blocks=args.num_kv_blocks, max_model_len=args.prompt_tokens + 2 * BLOCK_SIZE,
        max_num_batched_tokens=max(2048, args.prompt_tokens + BLOCK_SIZE), enable_prefix_caching=True, seed=SEED,
        **tier)  # type: ignore[arg-type]
    weights = dummy_weights(config, dtype=TORCH_DTYPES[dtype], device=device, seed=SEED)
    checkpoint = Checkpoint(config=config, weights=weights, tokenizer=byte_level_tokenizer(config),
                            path=dummy_checkpoint_path(args.shape), model_id=dummy_model_id(args.shape, SEED))
    return LLMEngine(engine_config, checkpoint=checkpoint)


def prompt(seed: int, tokens: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (tokens,), generator=g).tolist()


def first_token(engine: LLMEngine, request_id: str, tokens: list[int], device: torch.device) -> tuple[float, list[int]]:
    """Seconds to the request's first token (alone in the engine), and its greedy tokens (2)."""
    sync(device)
    start = time.perf_counter()
    engine.add_request(request_id, tokens, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    ttft = None
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if ttft is None and o.token_ids:
                sync(device)
                ttft = time.perf_counter() - start
            if o.finished:
                out = list(o.token_ids)
    assert ttft is not None
    return ttft, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tier", choices=("host", "disk"), default="host")
    p.add_argument("--tier-mib", type=int, default=1024)
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--num-kv-blocks", type=int, default=0, help="default: 1.5 prompts' worth")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if args.tier == "host" and device.type != "cuda":
        p.error("--tier host needs cuda (on cpu the KV cache is host memory already): use --tier disk")
    prompt_blocks = -(-args.prompt_tokens // BLOCK_SIZE)
    args.num_kv_blocks = args.num_kv_blocks or prompt_blocks * 3 // 2
    load_s: list[float] = []
    original = TierBlocks.load

    def timed_load(self: TierBlocks, block_id: int, block_hash: object) -> bool:
        sync(device)
        start = time.perf_counter()
        found = original(self, block_id, block_hash)  # type: ignore[arg-type]
        sync(device)
        if found:
            load_s.append(time.perf_counter() - start)
        return found

    TierBlocks.load = timed_load  # type: ignore[method-assign]
    rows = []
    with tempfile.TemporaryDirectory(prefix="splitserve-tier-bench-") as offload_dir:
        engine = build(args, device, offload_dir)
        vocab = engine.model_config.vocab_size
        first_token(engine, "warmup", prompt(10_000, args.prompt_tokens, vocab), device)
        print(f"{args.shape} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
              f"tier {args.tier}; {args.prompt_tokens}-token prompts = {prompt_blocks} blocks; device cache "
              f"{args.num_kv_blocks} blocks", flush=True)
        for r in range(args.rounds):
            tokens = prompt(r, args.prompt_tokens, vocab)
            cold_s, cold_out = first_token(engine, f"cold{r}", tokens, device)
            for e in range(2):  # two other prompts: the cold one's blocks are the LRU's oldest, evicted first
                first_token(engine, f"evict{r}.{e}", prompt(1_000 + 10 * r + e, args.prompt_tokens, vocab), device)
            assert engine.kv_tier is not None and engine.kv_tier.tier.flush(timeout_s=60.0), "the tier's writer"
            load_s.clear()
            warm_s, warm_out = first_token(engine, f"return{r}", tokens, device)
            assert warm_out == cold_out, f"round {r}: the returning prompt's tokens differ: {warm_out} != {cold_out}"
            per_block_load = statistics.median(load_s) if load_s else float("nan")
            per_block_compute = cold_s / prompt_blocks
            rows.append({"round": r, "cold_ttft_s": cold_s, "return_ttft_s": warm_s, "blocks_loaded": len(load_s),
                         "load_s_per_block": per_block_load, "compute_s_per_block": per_block_compute})
            print(f"round {r}: cold {cold_s * 1e3:8.1f} ms, returning {warm_s * 1e3:8.1f} ms "
                  f"({warm_s / cold_s:.2f}x), {len(load_s)} blocks loaded at {per_block_load * 1e6:7.1f} us each "
                  f"against {per_block_compute * 1e6:7.1f} us a block computed "
                  f"({per_block_load / per_block_compute:.3f}x)", flush=True)
        engine.close()
    summary = {k: statistics.median(row[k] for row in rows)
               for k in ("cold_ttft_s", "return_ttft_s", "load_s_per_block", "compute_s_per_block")}
    print(f"median: cold {summary['cold_ttft_s'] * 1e3:.1f} ms, returning {summary['return_ttft_s'] * 1e3:.1f} ms; "
          f"a block loaded {summary['load_s_per_block'] * 1e6:.1f} us against {summary['compute_s_per_block'] * 1e6:.1f}"
          f" us computed ({summary['load_s_per_block'] / summary['compute_s_per_block']:.3f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
