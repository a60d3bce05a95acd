"""The token bitmask: which tokens each constrained row may sample next, 32 tokens per int32 word.

    bitmask [num_masked, ceil(vocab_size / 32)] int32; token t of a row is allowed iff bit (t % 32) of word
    (t // 32) is set (xgrammar's layout). Masked-out tokens' logits become -inf.

`row_indices[i]` is the logits row that bitmask row i constrains; rows not listed are left alone. One call masks
the whole batch: xgrammar's kernel (CPU: vectorised C++; CUDA: its Triton kernel), with
`apply_token_bitmask_reference` as the torch definition the tests hold it to.

A `PendingBitmask` is a TokenBitmask still being filled on the grammar matchers' thread (engine/structured/
matchers.py, "Filling ahead"): the sampler calls `ready` on what it is given just before it masks, which waits.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

# Async scheduling: the tokens the step in flight samples for some structured requests, read on the host when called
# (request id -> token); their grammars accept them before they mask the next step (engine/structured/matchers.py).
InFlightTokens = Callable[[], dict[str, int]]


@dataclass(frozen=True)
class TokenBitmask:
    bitmask: torch.Tensor  # [num_masked, ceil(vocab_size / 32)] int32, on the CPU
    row_indices: list[int]  # the logits row each bitmask row constrains, len num_masked


class PendingBitmask:
    """A TokenBitmask being filled on another thread. `wait` blocks until it is filled and returns it, or raises
    what the fill raised (so a failed fill fails the step that needed it, through the step's own error path)."""

    def __init__(self, future: Future[TokenBitmask]) -> None:
        self._future = future

    def wait(self) -> TokenBitmask:
        return self._future.result()


def ready(mask: TokenBitmask | PendingBitmask) -> TokenBitmask:
    """The filled bitmask: `mask` itself, or a pending one once its fill has finished."""
    return mask.wait() if isinstance(mask, PendingBitmask) else mask


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Set to -inf, in place, the logits [num_rows, vocab_size] (float32) of every token its row's mask leaves
    out. The bitmask is copied to the logits' device first: without a host sync when it is in pinned memory, as the
    one filled ahead for a cuda step is."""
    import xgrammar as xgr

    vocab_size = logits.shape[1]
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    if len(mask.row_indices) == logits.shape[0] and mask.row_indices == list(range(logits.shape[0])):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
        return
    # xgrammar's `indices` name rows of both tensors; ours name logits rows for consecutive bitmask rows.
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device)
    full[mask.row_indices] = bitmask
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab_size, indices=mask.row_indices)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_masked, num_words] int32 -> [num_masked, vocab_size] bool, True where a token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_masked, num_words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[num_masked, vocab_size] bool -> [num_masked, ceil(vocab_size / 32)] int32 (xgrammar's layout)."""
    num_rows, vocab_size = allowed.shape
    num_words = (vocab_size + 31) // 32
    padded = torch.zeros(num_rows, num_words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab_size] = allowed.long()
    weights = torch.ones(32, dtype=torch.int64, device=allowed.device) << torch.arange(32, device=allowed.device)
    words = (padded.view(num_rows, num_words, 32) * weights).sum(-1)  # [num_rows, num_words], in [0, 2**32)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # the same 32 bits, as int32


def apply_token_bitmask_reference(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """The definition, in torch: what `apply_token_bitmask` must do."""
    allowed = unpack_bitmask(mask.bitmask.to(logits.device), logits.shape[1])  # [num_masked, vocab_size]
    rows = torch.tensor(mask.row_indices, dtype=torch.long, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
