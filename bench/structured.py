"""Structured outputs' cost: decode tokens/s under a JSON schema against unconstrained, at batch 1 and 32, in one run.

Both sides decode exactly `--max-tokens` tokens per request (EOS ignored; the schema, an array of at least 200
objects, cannot complete sooner), from the same chat prompt, greedy. Decode tokens/s for a batch of B is
B / mean TPOT (time per output token after the first), so prefill and the grammar's compile (done before the
timed runs, as a server's cache would have it) are out of it. The configurations take turns `--repeats` times and
each keeps its median, so that drift on a shared machine tilts neither side. The goal: at most 10% slower.

    .venv/bin/python bench/structured.py                   # the run recorded in docs/benchmarks.md
    .venv/bin/python bench/structured.py --batch-sizes 1 --repeats 1 --max-tokens 32   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from engine.request.grammar_spec import GrammarSpec  # noqa: E402

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
                assert len(out.token_ids) == max_tokens, (out.finish_reason, out.text[-200:])
                if spec is not None:
                    assert out.text.startswith("[{"), out.text[:100]
                tpots.append(out.stats.tpot_s)
    return batch_size / statistics.mean(tpots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    checkpoint = load_checkpoint(resolve_model(args.model), dtype=getattr(torch, args.dtype))
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=64),
                       checkpoint=checkpoint)
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    spec = GrammarSpec.json_schema(SCHEMA)
    start = time.perf_counter()
    engine.inputs.grammar_compilers().compile(spec)
    print(f"schema compiled in {time.perf_counter() - start:.3f} s; prompt {len(prompt)} tokens; "
          f"{args.max_tokens} output tokens per request; torch threads {torch.get_num_threads()}")
    decode_tokens_per_s(engine, prompt, 2, 8, spec)  # warm-up: both paths once
    decode_tokens_per_s(engine, prompt, 2, 8, None)

    print(f"{'batch':>5}  {'unconstrained tok/s':>20}  {'json schema tok/s':>18}  {'ratio':>6}  verdict")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        plain: list[float] = []
        constrained: list[float] = []
        for _ in range(args.repeats):  # taking turns
            plain.append(decode_tokens_per_s(engine, prompt, batch_size, args.max_tokens, None))
            constrained.append(decode_tokens_per_s(engine, prompt, batch_size, args.max_tokens, spec))
        p, c = statistics.median(plain), statistics.median(constrained)
        verdict = "met (<= 10% slower)" if c >= 0.9 * p else "NOT met (> 10% slower)"
        runs = f"{json.dumps([round(x, 1) for x in plain])} vs {json.dumps([round(x, 1) for x in constrained])}"
        print(f"{batch_size:>5}  {p:>20.1f}  {c:>18.1f}  {c / p:>6.3f}  {verdict}   runs: {runs}")


if __name__ == "__main__":
    main()
