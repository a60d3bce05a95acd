"""Loading a GGUF checkpoint: the loader before (gguf's stock `GGUFReader`, opened once for the weights and again
for the tokenizer) against ours (`load_checkpoint`: one `open_gguf` whose string and scalar arrays are read in one
loop, shared by the weights and the tokenizer), in one run. Both produce the same weights and tokenizer (checked).

    PYTHONPATH=. .venv/bin/python bench/model_load.py [--model smollm2-135m] [--repeats 3]

Prints each side's median wall time over --repeats alternating runs, the header parse alone for each reader, and
the ratio. This is the part of a worker's start (and restart) that the model load takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from gguf import GGUFReader  # noqa: E402

from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.gguf_loader import load_gguf, open_gguf  # noqa: E402
from engine.loader.model_registry import resolve_model  # noqa: E402
from engine.tokenizer.tokenizer import Tokenizer  # noqa: E402


def _before(path: str):  # type: ignore[no-untyped-def]
    """The loader as it was: the stock reader for the weights, another for the tokenizer."""
    config, weights = load_gguf(path, torch.float32, reader=GGUFReader(path))
    return config, weights, Tokenizer.from_gguf(GGUFReader(path))


def _timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    path = resolve_model(args.model)
    before_s, ours_s, stock_parse_s, our_parse_s = [], [], [], []
    for _ in range(args.repeats):
        t, (config, weights, tokenizer) = _timed(lambda: _before(str(path)))
        before_s.append(t)
        t, checkpoint = _timed(lambda: load_checkpoint(str(path)))
        ours_s.append(t)
        stock_parse_s.append(_timed(lambda: GGUFReader(path))[0])
        our_parse_s.append(_timed(lambda: open_gguf(path))[0])
    assert checkpoint.config == config and checkpoint.weights.keys() == weights.keys()
    assert all(torch.equal(checkpoint.weights[k], v) for k, v in weights.items())
    assert all(getattr(checkpoint.tokenizer.spec, f.name) == getattr(tokenizer.spec, f.name)
               for f in dataclasses.fields(tokenizer.spec))
    before, ours = statistics.median(before_s), statistics.median(ours_s)
    print(f"{path.name}, torch threads {torch.get_num_threads()}, {args.repeats} repeats (median)")
    print(f"header parse: stock GGUFReader {statistics.median(stock_parse_s):.2f} s, "
          f"open_gguf {statistics.median(our_parse_s):.2f} s")
    print(f"whole load:   before {before:.2f} s, ours {ours:.2f} s, {before / ours:.2f}x faster")


if __name__ == "__main__":
    main()
