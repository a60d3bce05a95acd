"""Layer-skip drafts: the target's first K layers, its final norm and head, greedy (see `model_drafter.py`).

The draft shares the target's weights and, for its K layers, the target's own KV cache: a token's K/V at a layer
below K depend only on the layers below, which draft and target share, so the target's KV of every computed token
(computed here, a prefix-cache hit or received from a prefill worker) is already the draft's, and the draft never
catches up. Nothing crosses the prefill → decode handoff for it beyond the target's KV, and it costs no memory.
The slots it writes for drafts are rewritten by the verification, in the same step, before the target reads them.
"""

from __future__ import annotations

import torch

from engine.core.scheduler import ScheduledRequest
from engine.model.llama import LlamaModel
from engine.spec_decode.model_drafter import ModelDrafter


class LayerSkipProposer(ModelDrafter):
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], *, num_layers: int, block_size: int) -> None:
        super().__init__(model.first_layers(num_layers), kv_caches[:num_layers], block_size=block_size)

    def draft_valid_until(self, item: ScheduledRequest) -> int:
        return item.start  # the target's KV is the draft's
