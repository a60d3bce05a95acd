"""`n` > 1 (and `best_of`): one request, several sequences that share its prompt's KV blocks.

The request a client sent is choice 0 (its own id); choices 1 .. n-1 are requests of their own (ids from
`choice_request_id`), created with it and kept on it as `pending_forks` until its prompt is computed. Then the
scheduler forks them (`Scheduler._fork`): each child takes a reference on the parent's full prompt blocks that
leave at least one prompt token out, and computes the rest of the prompt itself — at most one block of tokens —
into blocks of its own, which yields the logits its first token is sampled from:

    prompt (P = 10, B = 4)   [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 . .]
    parent table             [  b0       ][  b1       ][  b2      ]      b0, b1: ref count 1 + (n - 1)
    child table              [  b0       ][  b1       ][  c2      ]      c2: the child's, t8 t9 recomputed

No block is ever written by two requests: the shared ones are full and computed before the fork, the partial
last block is each child's own (recomputing B tokens at most costs less than a copy-on-write bookkeeping would
save). Disaggregated, the decode worker forks after the prefill worker's KV arrived (`commit_remote`); the prefill
worker samples only choice 0's first token. Every child is an ordinary request from then on (preemptible, freed
on finish or abort, speculation as any request); the engine aborts a request's children with it.

Per-choice seeds: choice i samples with seed + i (wrapped into the seed's range), so a seeded request gives the
same n choices every time, and distinct ones.
"""

from __future__ import annotations

import dataclasses

from engine.request.sampling_params import SamplingParams

_SEED_RANGE = 2**64  # validate() takes seeds in [-2**63, 2**64); torch seeds with their value mod 2**64


def choice_request_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of `request_id` (choice 0 is the request itself)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def parent_request_id(request_id: str, index: int) -> str:
    """The client request's id, from the engine id of its choice `index`."""
    return request_id if index == 0 else request_id.rsplit("#", 1)[0]


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling params of one sequence: one choice, its own seed; prompt logprobs only on choice 0."""
    seed = params.seed
    if seed is not None and index:
        seed = (seed + index) % _SEED_RANGE
    return dataclasses.replace(
        params, n=1, best_of=None, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None
    )


def num_shared_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The parent's leading blocks a child shares: full prompt blocks, at least one prompt token left out."""
    return (num_prompt_tokens - 1) // block_size
