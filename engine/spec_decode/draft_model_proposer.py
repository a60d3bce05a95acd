"""Draft-model drafts: a second, smaller model with the target's vocabulary, greedy (see `model_drafter.py`).

It is run by the same model code as the target, with its own paged KV cache: a tensor of its own layers, indexed by
the target's block ids, so that its slots are counted, freed and preempted with the request's blocks. What its KV
holds is tracked per request: the tokens it computed itself, since the request's last preemption (which hands the
blocks back). A prefix-cache hit or a prompt whose KV came from a prefill worker brings only the target's KV, so
the draft catches up over those tokens in its first forward (one prefill of the small model): nothing of the
draft crosses the prefill → decode handoff.
"""

from __future__ import annotations

from engine.attention.backend import get_attention_backend
from engine.core.scheduler import ScheduledRequest
from engine.huge_pages import zeros_with_huge_pages
from engine.loader.checkpoint import Checkpoint
from engine.model.llama import LlamaModel
from engine.spec_decode.model_drafter import ModelDrafter


def draft_kv_block_bytes(checkpoint: Checkpoint, block_size: int, itemsize: int) -> int:
    c = checkpoint.config
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * itemsize


class DraftModelProposer(ModelDrafter):
    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        target_vocab_size: int,
        num_blocks: int,
        block_size: int,
        max_positions: int,
        attention_backend: str,
    ) -> None:
        c = checkpoint.config
        if c.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({c.vocab_size} tokens) is not the target's ({target_vocab_size})"
            )
        if c.max_position_embeddings < max_positions:
            raise ValueError(
                f"the draft model's context ({c.max_position_embeddings}) is shorter than max_model_len "
                f"({max_positions})"
            )
        attention = get_attention_backend(attention_backend, scale=c.head_dim**-0.5)
        model = LlamaModel(c, checkpoint.weights, attention, max_positions=max_positions)
        # [num_layers, 2, num_blocks, block_size, Hkv, D], like the target's
        kv_cache = zeros_with_huge_pages(
            c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=model.dtype
        )
        super().__init__(model, list(kv_cache.unbind(0)), block_size=block_size)
        self.kv_cache = kv_cache
        self._valid: dict[str, tuple[int, int]] = {}  # request id -> (its num_preemptions, tokens the KV holds)

    def draft_valid_until(self, item: ScheduledRequest) -> int:
        request = item.request
        state = self._valid.get(request.request_id)
        if state is None or state[0] != request.num_preemptions:  # new here, or its blocks were handed back
            return 0
        return state[1]

    def drafted(self, item: ScheduledRequest) -> None:
        self._valid[item.request.request_id] = (item.request.num_preemptions, item.start + 1)

    def release(self, request_id: str) -> None:
        self._valid.pop(request_id, None)
