"""Which LoRA adapter each token of a step runs under, and the deltas it adds to the fused layers' outputs.

A step's tokens are flattened request by request (engine/model_runner.py's step order), so the tokens of one
adapter lie in runs: each run adds (x A^T) B^T to its rows of the output, two small GEMMs per adapter run and
layer (punica's segmented GEMM, as plain torch). Tokens of requests without an adapter get nothing added: the
base model's arithmetic, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.lora.adapter import LoRAAdapter


class LoRAStep:
    __slots__ = ("segments",)

    def __init__(self, segments: list[tuple[LoRAAdapter, int, int]]) -> None:
        self.segments = segments  # (adapter, first token, end), in token order, no overlap

    @classmethod
    def of(cls, runs: Iterable[tuple[LoRAAdapter | None, int]]) -> LoRAStep | None:
        """From each request's (adapter or None, tokens in this step), in step order; None when no token has one."""
        segments: list[tuple[LoRAAdapter, int, int]] = []
        offset = 0
        for adapter, num_tokens in runs:
            if adapter is not None and num_tokens > 0:
                if segments and segments[-1][0] is adapter and segments[-1][2] == offset:
                    segments[-1] = (adapter, segments[-1][1], offset + num_tokens)
                else:
                    segments.append((adapter, offset, offset + num_tokens))
            offset += num_tokens
        return cls(segments) if segments else None

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> torch.Tensor:
        """y[t] += (x[t] A^T) B^T for every token t under an adapter that targets `fused` in `layer`; y in place."""
        for adapter, start, end in self.segments:
            pair = adapter.layers[layer].get(fused)
            if pair is not None:
                y[start:end].addmm_(x[start:end] @ pair.a.T, pair.b.T)
        return y
