"""Structured outputs' cost: decode tokens/s under a JSON schema against unconstrained, at batch 1 and 32, in one run.

Both sides decode exactly `--max-tokens` tokens per request (EOS ignored; the schema, an array of at least 200
objects, cannot complete sooner), from the same chat prompt, greedy. Decode tokens/s for a batch of B is
B / mean TPOT (time per output token after the first), so prefill and the grammar's compile (done before the
timed runs, as a server's cache would have it) are out of it. The configurations take turns `--repeats` times and
each keeps its median, so that drift on a shared machine tilts neither side. The goal: at most 10% slower.

Where the engine fills the grammar bitmask ahead (a cuda engine: engine/structured/matchers.py, "Filling ahead"),
the schema also runs with the fill in the step (the CPU engine's way) as a third configuration, to show what the
overlap buys. Per structured configuration: the fill's median wall time per step, and how long the sampler waited
for a fill started ahead (the part the forward did not hide).

    .venv/bin/python bench/structured.py                   # the CPU run recorded in docs/benchmarks.md
    .venv/bin/python bench/structured.py --batch-sizes 1 --repeats 1 --max-tokens 32   # a quick look
    python3 bench/structured.py --device cuda --load-format dummy --tokenizer DIR --json structured.json  # a GPU

`--load-format dummy` runs the model's shape with random weights (engine/loader/dummy_shapes.py), on a machine
without the checkpoint. Its tokens are then whatever the grammar lets random logits pick; the fill's cost depends
on the vocabulary, so give the real tokenizer with `--tokenizer DIR` (an HF directory with tokenizer.json: for
SmolLM2, `../shared/tools/bench-tokenizer.sh` writes one, 3.5 MB); without it a dummy shape gets the byte-level
stand-in (256 byte tokens and placeholders), which runs but measures a different grammar cost.

Exit status: 0 when every run finished (whatever the ratios), 1 when one failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.device import TORCH_DTYPES, resolve_device, resolve_dtype  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from engine.request.grammar_spec import GrammarSpec  # noqa: E402
from engine.request.sampling_params import SamplingParams  # noqa: E402
from engine.structured import bitmask as bitmask_module  # noqa: E402
from engine.tokenizer.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {
    "type": "array", "minItems": 200,
    "items": {"type": "object", "required": ["id", "name", "kind", "score", "tags"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    }},
}
PROMPT = [{"role": "user", "content": "List many items (books, films, songs, games) as a JSON array."}]
SEED = 0
PLAIN, AHEAD, IN_STEP = "unconstrained", "json schema", "json schema, filled in the step"


class FillTimer:
    """Instruments one engine's grammar matchers: the wall time of each bitmask fill (on whichever thread) and of
    each wait the sampler made for a fill started ahead, in seconds."""

    def __init__(self, engine: LLMEngine) -> None:
        self.fill_s: list[float] = []
        self.wait_s: list[float] = []
        grammars = engine.runner.grammars
        assert grammars is not None
        fill_rows = grammars._fill_rows

        def timed_fill(*args: Any) -> None:
            start = time.perf_counter()
            fill_rows(*args)
            self.fill_s.append(time.perf_counter() - start)

        grammars._fill_rows = timed_fill  # type: ignore[method-assign]
        wait = bitmask_module.PendingBitmask.wait

        def timed_wait(pending: bitmask_module.PendingBitmask) -> bitmask_module.TokenBitmask:
            start = time.perf_counter()
            try:
                return wait(pending)
            finally:
                self.wait_s.append(time.perf_counter() - start)

        bitmask_module.PendingBitmask.wait = timed_wait  # type: ignore[method-assign]

    @contextmanager
    def collecting(self) -> Iterator[tuple[list[float], list[float]]]:
        """The fill and wait times of what runs inside, in two fresh lists."""
        self.fill_s, self.wait_s = [], []
        yield self.fill_s, self.wait_s


def decode_tokens_per_s(engine: LLMEngine, prompt: list[int], batch_size: int, max_tokens: int,
                        spec: GrammarSpec | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=spec)
    ids = [f"{time.monotonic_ns()}-{i}" for i in range(batch_size)]
    for request_id in ids:
        engine.add_request(request_id, prompt, params)
    tpots = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                assert len(out.token_ids) == max_tokens, (out.finish_reason, out.text[-200:])
                if spec is not None:
                    assert out.text.startswith("[{"), out.text[:100]
                tpots.append(out.stats.tpot_s)
    assert engine.block_pool.num_used_blocks == 0, "KV blocks leaked"
    return batch_size / statistics.mean(tpots)


def build_engine(args: argparse.Namespace) -> LLMEngine:
    device = resolve_device(args.device)
    dtype_name = resolve_dtype(args.dtype, device)
    max_num_seqs = max(args.batch_sizes)
    max_model_len = 256 + args.max_tokens
    config = EngineConfig(model=args.model, device=str(device), dtype=dtype_name, load_format=args.load_format,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=SEED,
                          num_kv_blocks=max_num_seqs * (-(-max_model_len // 16)) + 16,
                          enforce_eager=args.enforce_eager)
    tokenizer = Tokenizer.from_hf_dir(args.tokenizer) if args.tokenizer else None
    if args.load_format == "dummy":
        from engine.loader.dummy_weights import (
            byte_level_tokenizer,
            dummy_checkpoint_path,
            dummy_model_config,
            dummy_model_id,
            dummy_weights,
        )

        model_config = dummy_model_config(args.model)
        checkpoint = Checkpoint(
            config=model_config,
            weights=dummy_weights(model_config, dtype=TORCH_DTYPES[dtype_name], device=device, seed=SEED),
            # no fetch attempt: a GPU machine has no network (module docstring)
            tokenizer=tokenizer or byte_level_tokenizer(model_config),
            path=dummy_checkpoint_path(args.model), model_id=dummy_model_id(args.model, SEED))
    else:
        checkpoint = load_checkpoint(str(resolve_model(args.model)), dtype=TORCH_DTYPES[dtype_name])
        if tokenizer is not None:
            checkpoint = dataclasses.replace(checkpoint, tokenizer=tokenizer)
    if checkpoint.tokenizer.vocab_size > checkpoint.config.vocab_size:
        raise SystemExit(f"--tokenizer has {checkpoint.tokenizer.vocab_size} tokens, more than the model's "
                         f"{checkpoint.config.vocab_size}")
    return LLMEngine(config, checkpoint=checkpoint)


def prompt_ids(engine: LLMEngine) -> list[int]:
    tok = engine.tokenizer
    try:
        text = tok.apply_chat_template(PROMPT)
    except ValueError:  # the stand-in tokenizer has no chat template
        text = PROMPT[0]["content"]
    return tok.encode(text, add_special_tokens=False)


def device_name(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"cpu ({os.cpu_count()} logical cores, torch threads {torch.get_num_threads()})"


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    engine = build_engine(args)
    spec = GrammarSpec.json_schema(SCHEMA)
    start = time.perf_counter()
    engine.inputs.grammar_compilers().compile(spec)
    compile_s = time.perf_counter() - start
    grammars = engine.runner.grammars
    assert grammars is not None
    if args.fill_ahead:
        grammars.fill_ahead = True
    ahead = grammars.fill_ahead  # the engine's own choice (on for cuda), or --fill-ahead
    configs: dict[str, Callable[[], None]] = {PLAIN: lambda: None}
    configs[AHEAD if ahead else "json schema"] = lambda: setattr(grammars, "fill_ahead", ahead)
    if ahead:
        configs[IN_STEP] = lambda: setattr(grammars, "fill_ahead", False)
    timer = FillTimer(engine)
    prompt = prompt_ids(engine)
    report: dict[str, Any] = {
        "device": device_name(engine), "torch": torch.__version__, "model": args.model,
        "load_format": args.load_format, "dtype": engine.config.dtype,
        "tokenizer": engine.tokenizer.spec.source or args.tokenizer,
        "cuda_graphs": engine.cuda_graph_capture_seconds is not None, "fills_ahead": ahead,
        "schema_compile_s": compile_s, "prompt_tokens": len(prompt), "max_tokens": args.max_tokens,
        "repeats": args.repeats, "batches": [],
    }
    print(f"device {report['device']}; {report['dtype']}; {args.model} ({args.load_format}); tokenizer "
          f"{report['tokenizer']}; CUDA graphs {report['cuda_graphs']}; fills ahead {ahead}", flush=True)
    print(f"schema compiled in {compile_s:.3f} s; prompt {len(prompt)} tokens; {args.max_tokens} output tokens per "
          f"request; torch threads {torch.get_num_threads()}", flush=True)
    for name, use in configs.items():  # warm-up: every path once (kernels compiled, graphs replayed)
        use()
        decode_tokens_per_s(engine, prompt, 2, 8, None if name == PLAIN else spec)

    names = list(configs)
    header = "".join(f"  {name + ' tok/s':>{max(len(name) + 6, 12)}}" for name in names)
    print(f"{'batch':>5}{header}  {'ratio':>6}  verdict", flush=True)
    for batch_size in args.batch_sizes:
        runs: dict[str, list[float]] = {name: [] for name in names}
        fill_ms: dict[str, list[float]] = {name: [] for name in names[1:]}
        wait_ms: dict[str, list[float]] = {name: [] for name in names[1:]}
        for _ in range(args.repeats):  # taking turns
            for name, use in configs.items():
                use()
                with timer.collecting() as (fills, waits):
                    runs[name].append(decode_tokens_per_s(engine, prompt, batch_size, args.max_tokens,
                                                          None if name == PLAIN else spec))
                if name != PLAIN:
                    fill_ms[name] += [s * 1e3 for s in fills]
                    wait_ms[name] += [s * 1e3 for s in waits]
        medians = {name: statistics.median(values) for name, values in runs.items()}
        ratio = medians[names[1]] / medians[PLAIN]
        row: dict[str, Any] = {"batch": batch_size, "tok_s": medians, "runs": runs, "ratio": ratio,
                               "fill_ms_median": {n: _median(v) for n, v in fill_ms.items()},
                               "wait_ms_median": {n: _median(v) for n, v in wait_ms.items()}}
        if IN_STEP in medians:
            row["ratio_in_step"] = medians[IN_STEP] / medians[PLAIN]
        report["batches"].append(row)
        verdict = "met (<= 10% slower)" if ratio >= 0.9 else "NOT met (> 10% slower)"
        cells = "".join(f"  {medians[name]:>{max(len(name) + 6, 12)}.1f}" for name in names)
        print(f"{batch_size:>5}{cells}  {ratio:>6.3f}  {verdict}", flush=True)
        details = "; ".join(f"{name}: fill {row['fill_ms_median'][name]:.3f} ms/step median"
                            + (f", sampler waited {row['wait_ms_median'][name]:.3f} ms" if wait_ms[name] else "")
                            for name in names[1:])
        print(f"       runs {json.dumps({n: [round(x, 1) for x in v] for n, v in runs.items()})}; {details}"
              + (f"; in-step ratio {row['ratio_in_step']:.3f}" if "ratio_in_step" in row else ""), flush=True)
    report["total_s"] = time.perf_counter() - started
    return report


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a registered model, or with dummy a shape")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--tokenizer", default=None, help="an HF tokenizer directory to use instead of the model's")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--fill-ahead", action="store_true",
                        help="fill the bitmask ahead on a CPU engine too (a cuda engine always does)")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = run(args)
    except Exception:  # noqa: BLE001 - the run failed: say why, exit 1
        traceback.print_exc()
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
