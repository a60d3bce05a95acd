"""Greedy drafting with a model over paged KV, shared by the layer-skip and draft-model proposers.

A model proposer drafts after the schedule, into slots the scheduler allocated for the request's drafts (before
the schedule it reserves them with placeholder drafts, `PLACEHOLDER_TOKEN_ID`, never verified). Its KV is
indexed by the request's own block table, so its slots are counted, freed and preempted with the request's
blocks and need no bookkeeping of their own.

    position   v ... p-1        p = num_computed     p+1   ...   p+k-1
    draft in   catch-up         last real token      d0    ...   d(k-2)      first forward: catch-up + p together
    draft out                   d0                   d1    ...   d(k-1)
    verify in                   last real token      d0    ...   d(k-2)   d(k-1)    (the same step)

`v` is where the draft's own KV stops being valid for the request (a proposer's `draft_valid_until`); from v the
first forward catches up with a chunk, as a prefill does, and ends in the first draft. The k - 1 others are one
batched decode forward each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.metadata import AttentionMetadata
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.model.llama import LlamaModel
from engine.model_runner import prepare_step, step_order

PLACEHOLDER_TOKEN_ID = 0


class ModelDrafter:
    drafts_after_schedule = True

    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], *, block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches  # per draft layer [2, num_blocks, block_size, Hkv, D], indexed by the target's ids
        self.block_size = block_size

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Slot reservations: `draft` fills them once the scheduler has allocated them."""
        return [[PLACEHOLDER_TOKEN_ID] * k for k in num_drafts]

    def draft_valid_until(self, item: ScheduledRequest) -> int:
        """How many of the request's first tokens the draft's KV holds now (<= item.start)."""
        raise NotImplementedError

    def drafted(self, item: ScheduledRequest) -> None:
        """The draft's KV now holds the request's tokens up to item.start, inclusive (accepted drafts may be
        rejected: anything after is not counted on)."""

    @torch.inference_mode()
    def draft(self, items: Sequence[ScheduledRequest]) -> None:
        """Replace each item's placeholder drafts with greedy draft tokens, in place."""
        items = [item for item in items if item.spec_token_ids]
        if not items:
            return
        # The first forward: each request's catch-up chunk, ending at its last real token -> its first draft.
        chunks = {id(chunk): (chunk, item) for item in items for chunk in [self._catch_up(item)]}
        first = step_order([chunk for chunk, _ in chunks.values()])
        input_ids, positions, meta = prepare_step(first, self.block_size)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        first_ids = self.model.compute_logits(hidden[_last_rows(first)]).argmax(dim=-1).tolist()
        drafts: dict[int, list[int]] = {id(chunks[id(c)][1]): [t] for c, t in zip(first, first_ids, strict=True)}
        # Then one decode forward per further draft position.
        for j in range(1, max(len(item.spec_token_ids) for item in items)):
            active = sorted((item for item in items if len(item.spec_token_ids) > j), key=lambda s: s.start + j)
            token_ids = [drafts[id(item)][j - 1] for item in active]
            positions_j = [item.start + j for item in active]
            meta_j = self._decode_meta(active, positions_j)
            hidden = self.model.forward(torch.tensor(token_ids), torch.tensor(positions_j), self.kv_caches, meta_j)
            for item, token_id in zip(active, self.model.compute_logits(hidden).argmax(dim=-1).tolist(), strict=True):
                drafts[id(item)].append(token_id)
        for item in items:
            item.spec_token_ids = drafts[id(item)]
            self.drafted(item)

    def _catch_up(self, item: ScheduledRequest) -> ScheduledRequest:
        """The first forward's share of `item`: from where the draft's KV stops to the last real token."""
        valid = min(self.draft_valid_until(item), item.start)
        return ScheduledRequest(
            request=item.request, start=valid, num_new_tokens=item.start + 1 - valid, block_ids=item.block_ids,
            samples=True,
        )

    def _decode_meta(self, items: list[ScheduledRequest], positions: list[int]) -> AttentionMetadata:
        """One decode token per item at `positions` (ascending), in slots of the item's block table."""
        bs = self.block_size
        tables = [item.block_ids for item in items]
        width = max(len(t) for t in tables)
        return AttentionMetadata(
            num_tokens=len(items),
            slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]),
            num_decode_tokens=len(items),
            decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
            decode_seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int64),
            prefills=(),
        )

    def release(self, request_id: str) -> None:
        """Nothing is kept per request (a subclass that keeps something drops it)."""


def _last_rows(items: list[ScheduledRequest]) -> list[int]:
    """The row of each item's last token in the flattened step."""
    offset, rows = 0, []
    for item in items:
        offset += item.num_new_tokens
        rows.append(offset - 1)
    return rows
