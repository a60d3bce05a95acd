"""Logit adjustments that look at the request's history: min_tokens masking and vLLM's three penalties.

They run on the raw logits before the greedy/random split (so they steer greedy decoding too), in this order:
min_tokens masking, repetition penalty, then frequency and presence penalties. All three work in place on the
(row, token id) positions involved, never on a dense [num_rows, vocab_size] tensor, so their cost follows the
length of the histories. Every token id must be < vocab_size.
"""

from __future__ import annotations

import torch


def mask_tokens(logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Set logits[row_ids[i], token_ids[i]] to -inf for every i, in place.

    logits: [num_rows, vocab_size]; row_ids, token_ids: [num_masked] int64.
    """
    logits.index_put_((row_ids, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_repetition_penalty(
    logits: torch.Tensor, penalty: torch.Tensor, seen_row_ids: torch.Tensor, seen_token_ids: torch.Tensor
) -> None:
    """Penalise every token seen in the prompt or the output so far (CTRL / HF / vLLM semantics), in place.

    logits: [num_rows, vocab_size]; penalty: [num_rows] > 0 (1 is neutral); seen_*: [num_seen] int64 (row, token
    id) pairs, duplicates allowed. A seen token's logit is divided by the penalty when positive and multiplied by
    it otherwise, so a penalty > 1 always makes the token less likely.
    """
    values = logits[seen_row_ids, seen_token_ids]  # [num_seen]
    row_penalty = penalty[seen_row_ids]  # [num_seen]
    # Duplicate positions compute the same value from the same original, so writing them all is safe.
    logits[seen_row_ids, seen_token_ids] = torch.where(values > 0, values / row_penalty, values * row_penalty)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    output_row_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
) -> None:
    """logit -= frequency * count + presence * (count > 0), counting output tokens only (OpenAI semantics).

    logits: [num_rows, vocab_size], modified in place; *_penalty: [num_rows] (0 is neutral); output_*:
    [num_output] int64, one (row, token id) pair per output token, repeats included.
    """
    vocab_size = logits.shape[1]
    keys, counts = torch.unique(output_row_ids * vocab_size + output_token_ids, return_counts=True)  # [num_distinct]
    row_ids, token_ids = keys // vocab_size, keys % vocab_size
    values = logits[row_ids, token_ids]  # [num_distinct]
    # The same two subtractions, in the same order, as the dense `logits - f * counts - p * (counts > 0)`.
    frequency_term = frequency_penalty[row_ids] * counts.to(logits.dtype)  # [num_distinct]
    logits[row_ids, token_ids] = values - frequency_term - presence_penalty[row_ids]
