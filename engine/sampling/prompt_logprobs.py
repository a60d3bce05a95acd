"""vLLM's `prompt_logprobs`: how likely the model found each prompt token given the ones before it.

Position j's logits predict token j + 1, so a prompt of P tokens has P - 1 prompt logprobs (its first token has
none), taken from the logits of positions 0 .. P - 2 as the prefill computes them, chunk by chunk:

    prompt     t0   t1   t2   t3   t4        P = 5
    position   0    1    2    3    4
    predicts   t1   t2   t3   t4   (first output token: sampled, not a prompt logprob)

Raw logits, like the sampled tokens' logprobs (no bias, penalty or temperature). A prefix-cache hit has no logits
for the cached positions, so a request that asks for prompt logprobs skips the prefix cache (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request.logprobs import TokenLogprobs


def prompt_positions(start: int, num_new_tokens: int, num_prompt_tokens: int) -> range:
    """The positions of a chunk [start, start + num_new_tokens) whose logits give a prompt logprob."""
    return range(start, min(start + num_new_tokens, num_prompt_tokens - 1))


def prompt_token_logprobs(logits: torch.Tensor, target_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """logits: [num_positions, vocab_size] at consecutive positions; target_ids: the token after each position.
    One TokenLogprobs per position: the target's logprob, its 1-based rank, and the `num_top` most likely."""
    logprobs = logits.float().log_softmax(dim=-1)  # [num_positions, vocab_size]
    targets = torch.tensor(list(target_ids), dtype=torch.int64, device=logits.device).unsqueeze(1)  # [num_positions, 1]
    target_logprobs = logprobs.gather(-1, targets)  # [num_positions, 1]
    ranks = (logprobs >= target_logprobs).sum(dim=-1).tolist()  # counts the token itself: 1-based
    top_values: list[list[float]] = [[] for _ in target_ids]
    top_ids: list[list[int]] = [[] for _ in target_ids]
    if num_top > 0:
        values, ids = logprobs.topk(num_top, dim=-1)  # [num_positions, num_top], descending
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(token_id=token_id, logprob=logprob, rank=rank, top=list(zip(ids_, values_, strict=True)))
        for token_id, logprob, rank, ids_, values_ in zip(
            target_ids, target_logprobs.squeeze(1).tolist(), ranks, top_ids, top_values, strict=True
        )
    ]
