"""Which LoRA adapter each token of a step runs under, and the deltas it adds to the fused layers' outputs.

A step's tokens are flattened request by request (engine/model_runner.py's step order: decodes by context length),
so one adapter's tokens may lie in several runs. Each adapter's delta is two GEMMs over all its tokens at once
(punica's segmented GEMM, as plain torch): where each adapter's tokens are one run they are read in place; else the
step gathers its adapter tokens grouped by adapter once per layer input (one `index_select`), and adds the deltas
back with one `index_add_`. A step's cost is then two GEMMs per adapter and layer, however its requests interleave.
Tokens of requests without an adapter get nothing added: the base model's arithmetic, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.host_copy import to_device
from engine.lora.adapter import LoRAAdapter


class LoRAStep:
    __slots__ = ("segments", "rows")

    def __init__(self, segments: list[tuple[LoRAAdapter, int, int]], rows: torch.Tensor | None = None) -> None:
        # (adapter, first token, end): in the step's token order, or (`rows` set) in the order of `rows`, the step's
        # adapter tokens grouped by adapter
        self.segments = segments
        self.rows = rows

    @classmethod
    def of(cls, runs: Iterable[tuple[LoRAAdapter | None, int]], device: torch.device | None = None
           ) -> LoRAStep | None:
        """From each request's (adapter or None, tokens in this step), in step order; None when no token has one."""
        by_adapter: dict[LoRAAdapter, list[tuple[int, int]]] = {}
        offset = 0
        for adapter, num_tokens in runs:
            if adapter is not None and num_tokens > 0:
                spans = by_adapter.setdefault(adapter, [])
                if spans and spans[-1][1] == offset:
                    spans[-1] = (spans[-1][0], offset + num_tokens)
                else:
                    spans.append((offset, offset + num_tokens))
            offset += num_tokens
        if not by_adapter:
            return None
        if all(len(spans) == 1 for spans in by_adapter.values()):  # each adapter's tokens in one run: in place
            return cls([(adapter, *spans[0]) for adapter, spans in by_adapter.items()])
        rows: list[int] = []
        segments = []
        for adapter, spans in by_adapter.items():
            first = len(rows)
            for start, end in spans:
                rows.extend(range(start, end))
            segments.append((adapter, first, len(rows)))
        return cls(segments, to_device(torch.tensor(rows, dtype=torch.int64), device))

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> torch.Tensor:
        """y[t] += (x[t] A^T) B^T for every token t under an adapter that targets `fused` in `layer`; y in place."""
        if self.rows is None:
            for adapter, start, end in self.segments:
                pair = adapter.layers[layer].get(fused)
                if pair is not None:
                    y[start:end].addmm_(x[start:end] @ pair.a.T, pair.b.T)
            return y
        pairs = [(adapter.layers[layer].get(fused), start, end) for adapter, start, end in self.segments]
        if all(pair is None for pair, _, _ in pairs):
            return y
        grouped = x.index_select(0, self.rows)
        delta = y.new_zeros(grouped.shape[0], y.shape[1])
        for pair, start, end in pairs:
            if pair is not None:
                torch.mm(grouped[start:end] @ pair.a.T, pair.b.T, out=delta[start:end])
        return y.index_add_(0, self.rows, delta)
