"""Layer-skip drafts: the target's first K layers, its final norm and head, greedy, one token per forward.

The draft shares the target's weights and, for its K layers, the target's own KV cache: a token's K/V at a layer
below K depend only on the layers below, which draft and target share, so the target's KV of every computed token
(computed here, a prefix-cache hit or received from a prefill worker) is already the draft's. Nothing crosses the
prefill → decode handoff for it beyond the target's KV, and preemption, aborts and prefix caching need nothing
extra: its slots are the request's own.

It drafts after the schedule, into slots the scheduler allocated for the request's drafts:

    position   p = num_computed     p+1    ...   p+k-1          p+k
    draft in   last real token      d0     ...   d(k-2)
    draft out  d0                   d1     ...   d(k-1)
    verify in  last real token      d0     ...   d(k-2)         d(k-1)   (the same step, all layers: the target
                                                                          rewrites these slots before reading)

Before the schedule it reserves those slots with placeholder drafts (`PLACEHOLDER_TOKEN_ID`, never verified),
which `draft` replaces with the real ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.metadata import AttentionMetadata
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.model.llama import LlamaModel

PLACEHOLDER_TOKEN_ID = 0


class LayerSkipProposer:
    drafts_after_schedule = True

    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], *, num_layers: int, block_size: int) -> None:
        self.model = model.first_layers(num_layers)
        self.kv_caches = kv_caches[:num_layers]  # per layer [2, num_blocks, block_size, Hkv, D]: the target's
        self.block_size = block_size

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Slot reservations: `draft` fills them once the scheduler has allocated them."""
        return [[PLACEHOLDER_TOKEN_ID] * k for k in num_drafts]

    @torch.inference_mode()
    def draft(self, items: Sequence[ScheduledRequest]) -> None:
        """Replace each item's placeholder drafts with greedy draft tokens (in place), one batched forward per
        draft position."""
        items = [item for item in items if item.spec_token_ids]
        drafts: dict[int, list[int]] = {id(item): [] for item in items}
        for j in range(max((len(item.spec_token_ids) for item in items), default=0)):
            active = sorted((item for item in items if len(item.spec_token_ids) > j), key=lambda s: s.start + j)
            token_ids = [
                item.request.all_token_ids[item.start] if j == 0 else drafts[id(item)][j - 1] for item in active
            ]
            positions = [item.start + j for item in active]
            meta = self._decode_metadata(active, positions)
            hidden = self.model.forward(torch.tensor(token_ids), torch.tensor(positions), self.kv_caches, meta)
            next_ids = self.model.compute_logits(hidden).argmax(dim=-1).tolist()  # [num_active]
            for item, token_id in zip(active, next_ids, strict=True):
                drafts[id(item)].append(token_id)
        for item in items:
            item.spec_token_ids = drafts[id(item)]

    def _decode_metadata(self, items: list[ScheduledRequest], positions: list[int]) -> AttentionMetadata:
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
        """Nothing is kept per request."""
