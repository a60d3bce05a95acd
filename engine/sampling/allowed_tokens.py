"""vLLM's `allowed_token_ids`: a row may sample only these tokens. Every other token's logit becomes -inf, after
min_tokens masking, logit_bias and the penalties and before a grammar's bitmask: a hard mask, unlike a bias.
Logprobs stay the model's raw ones (taken before any shaping), as vLLM's default.

Dense per masked row ([num_masked_rows, vocab_size] of additive 0 / -inf), built only for the rows that set it.
The engine refuses a list that would leave nothing to sample (engine/input_processor.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import to_device


@dataclass(frozen=True)
class AllowedTokensStage:
    row_ids: torch.Tensor  # [num_masked_rows] int64 step rows
    local_rows: torch.Tensor  # [num_allowed] int64, into row_ids
    token_ids: torch.Tensor  # [num_allowed] int64

    @classmethod
    def from_rows(
        cls, allowed: Sequence[Sequence[int]], vocab_size: int, device: torch.device
    ) -> AllowedTokensStage | None:
        """`allowed[row]` per step row (empty: no restriction); None when no row sets one. Ids at or past
        `vocab_size` are dropped (the engine refuses them when a request is added)."""
        row_ids: list[int] = []
        local_rows: list[int] = []
        token_ids: list[int] = []
        for row_id, ids in enumerate(allowed):
            if not ids:
                continue
            local = len(row_ids)
            row_ids.append(row_id)
            for token_id in ids:
                if 0 <= token_id < vocab_size:
                    local_rows.append(local)
                    token_ids.append(token_id)
        if not row_ids:
            return None
        return cls(*(to_device(torch.tensor(values, dtype=torch.int64), device)
                     for values in (row_ids, local_rows, token_ids)))

    def apply(self, logits: torch.Tensor) -> None:
        """Mask `logits` [num_rows, vocab_size] (float32) in place: -inf but at each masked row's allowed ids."""
        mask = torch.full((self.row_ids.shape[0], logits.shape[1]), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        mask[self.local_rows, self.token_ids] = 0.0
        logits[self.row_ids] = logits[self.row_ids] + mask
