"""OpenAI's `logit_bias`: a per-request map token id -> bias in [-100, 100], added to that token's logit before
every sampling step (greedy ones too), after min_tokens masking and before the penalties, as in vLLM.

Sparse like the penalties: flat (step row, token id, bias) triples, so a step costs what the biases it carries
cost, never num_rows * vocab_size. Logprobs are the model's raw ones (taken before any shaping), as vLLM's
default. A bias of -100 makes a token practically unreachable and +100 practically certain; neither is a hard
mask (as in OpenAI's API).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import to_device


@dataclass(frozen=True)
class LogitBiasStage:
    row_ids: torch.Tensor  # [num_biases] int64, step rows
    token_ids: torch.Tensor  # [num_biases] int64
    biases: torch.Tensor  # [num_biases] float32

    @classmethod
    def from_rows(
        cls, biases: Sequence[Mapping[int, float]], vocab_size: int, device: torch.device
    ) -> LogitBiasStage | None:
        """One step's biases, `biases[row]` per step row (empty: none); None when no row has any. Token ids at or
        past `vocab_size` are dropped (the engine refuses them when a request is added)."""
        row_ids: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for row_id, row_biases in enumerate(biases):
            for token_id, bias in row_biases.items():
                if 0 <= token_id < vocab_size and bias != 0.0:
                    row_ids.append(row_id)
                    token_ids.append(token_id)
                    values.append(bias)
        if not row_ids:
            return None
        return cls(
            row_ids=to_device(torch.tensor(row_ids, dtype=torch.int64), device),
            token_ids=to_device(torch.tensor(token_ids, dtype=torch.int64), device),
            biases=to_device(torch.tensor(values, dtype=torch.float32), device),
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Add the biases to `logits` [num_rows, vocab_size] (float32) in place. A row's token ids are distinct
        (they are a dict's keys), so no position is written twice."""
        logits.index_put_((self.row_ids, self.token_ids), self.biases.to(logits.dtype), accumulate=True)
