"""Turns a scheduler step into one flattened forward pass and samples the requests that reached their end,
verifying their draft tokens (if any) in the same pass.

The runner owns the KV tensors (one per layer) and the per-request seeded generators; the control plane owns
the block ids that index them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.metadata import AttentionMetadata, PrefillChunk
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.huge_pages import zeros_with_huge_pages
from engine.model.llama import LlamaModel
from engine.sampling.rejection_sampler import RejectionSampler, VerifyRequest
from engine.sampling.sampler import Sampler, SamplingRow, TokenLogprobs
from engine.structured.bitmask import TokenBitmask

if TYPE_CHECKING:
    from engine.structured.matchers import GrammarMatchers


class ModelRunner:
    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int, seed: int | None = None) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        # Every layer's KV in one tensor, so that one block across all layers (what a KV handoff moves) is read
        # or written in a single strided copy: kv_cache[:, :, block_id] is [num_layers, 2, block_size, Hkv, D].
        # [num_layers, 2, num_blocks, block_size, Hkv, D]
        self.kv_cache = zeros_with_huge_pages(
            c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=model.dtype
        )
        self.kv_caches = list(self.kv_cache.unbind(0))  # per layer [2, num_blocks, block_size, Hkv, D], contiguous
        self.sampler = Sampler(seed=seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self._generators: dict[str, torch.Generator] = {}
        # Structured outputs: the requests' grammar matchers (set by the engine; None: no request may have one).
        self.grammars: GrammarMatchers | None = None

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator and grammar matcher."""
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """Run one step. Returns, for each request that samples, its accepted draft tokens followed by the token
        sampled after them (one token when it has no drafts), and their logprobs where asked."""
        items = step_order(out.scheduled)
        input_ids, positions, meta = prepare_step(items, self.block_size)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)

        logit_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        offset = 0
        for item in items:
            offset += item.num_new_tokens
            if item.samples:
                logit_rows.extend(range(offset - item.num_sample_positions, offset))
                sampling.append(item)
        if not sampling:
            return {}, {}
        logits = self.model.compute_logits(hidden[logit_rows])  # [num_sample_positions summed, vocab]
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if not any(item.spec_token_ids for item in sampling):
            rows = [self._sampling_row(item) for item in sampling]
            result = self.sampler.sample(logits, rows, self._grammar_bitmask(sampling))
            for item, token_id, token_logprobs in zip(sampling, result.token_ids, result.logprobs, strict=True):
                sampled[item.request.request_id] = [token_id]
                if token_logprobs is not None:
                    logprobs[item.request.request_id] = [token_logprobs]
            return sampled, logprobs
        logits, num_drafts, token_bitmask = self._check_drafts(logits, sampling)
        requests = [
            VerifyRequest(
                rows=[self._sampling_row(item, item.spec_token_ids[:j]) for j in range(num + 1)],
                draft_token_ids=item.spec_token_ids[:num],
            )
            for item, num in zip(sampling, num_drafts, strict=True)
        ]
        verified_all = self.rejection_sampler.verify(logits, requests, token_bitmask)
        for item, verified in zip(sampling, verified_all, strict=True):
            sampled[item.request.request_id] = verified.token_ids
            if verified.logprobs is not None:
                logprobs[item.request.request_id] = verified.logprobs
        return sampled, logprobs

    def _grammar_bitmask(self, sampling: list[ScheduledRequest]) -> TokenBitmask | None:
        """The grammar masks of the structured requests among `sampling` (one logits row each), or None."""
        structured = [i for i, item in enumerate(sampling) if item.request.sampling_params.structured_outputs]
        if not structured:
            return None
        assert self.grammars is not None, "a structured request reached an engine without grammar support"
        return self.grammars.fill([sampling[i].request for i in structured], structured)

    def _check_drafts(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, list[int], TokenBitmask | None]:
        """Structured requests' drafts are cut at the first token their grammar rejects, before verification.

        logits: [sum of num_sample_positions, vocab_size]. Returns the logits of the positions still to verify,
        each request's number of drafts kept, and the grammar masks of the structured requests' positions."""
        num_drafts = [len(item.spec_token_ids) for item in sampling]
        if self.grammars is None or not any(item.request.sampling_params.structured_outputs for item in sampling):
            return logits, num_drafts, None
        bitmask = self.grammars.allocate(logits.shape[0])  # [positions, words]: a row per kept position
        kept_rows: list[int] = []  # logits rows still verified
        masked_rows: list[int] = []  # their indices (in the kept logits) that a grammar constrains
        offset = 0
        for i, item in enumerate(sampling):
            if item.request.sampling_params.structured_outputs:
                num_drafts[i] = self.grammars.fill_with_drafts(item.request, item.spec_token_ids, bitmask,
                                                               len(kept_rows))
                masked_rows.extend(range(len(kept_rows), len(kept_rows) + num_drafts[i] + 1))
            kept_rows.extend(range(offset, offset + num_drafts[i] + 1))
            offset += item.num_sample_positions
        if len(kept_rows) < logits.shape[0]:
            logits = logits[kept_rows]
        token_bitmask = TokenBitmask(bitmask=bitmask[masked_rows], row_indices=masked_rows)
        return logits, num_drafts, token_bitmask

    def _sampling_row(self, item: ScheduledRequest, accepted_drafts: list[int] | None = None) -> SamplingRow:
        """The request's row for its next token, or for the token after `accepted_drafts` (as if they had been
        output: penalties and min_tokens count them)."""
        request = item.request
        params = request.sampling_params
        generator = None
        if params.seed is not None:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator().manual_seed(params.seed)
                self._generators[request.request_id] = generator
        output_token_ids: list[int] = request.output_token_ids
        if accepted_drafts:
            output_token_ids = output_token_ids + accepted_drafts
        return SamplingRow(
            params=params,
            generator=generator,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=output_token_ids,
            eos_token_ids=request.eos_token_ids,
        )


def step_order(items: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes first, shortest context first (the attention backend groups them by length); then prefills and
    draft verifications (several tokens after a cached context: the same attention as a prefill chunk)."""
    return sorted(items, key=lambda s: (s.num_new_tokens != 1, s.start if s.num_new_tokens == 1 else 0))


def prepare_step(
    items: list[ScheduledRequest], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids, positions and attention metadata of `items` (in `step_order`), flattened in that order."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    for item in items:
        start, n, table = item.start, item.num_new_tokens, item.block_ids
        ids.extend(item.request.all_token_ids[start : start + n - len(item.spec_token_ids)])
        ids.extend(item.spec_token_ids)
        positions = range(start, start + n)
        pos.extend(positions)
        slots.extend(table[p // bs] * bs + p % bs for p in positions)
        if n == 1:
            decode_tables.append(table)
            decode_lens.append(start + 1)
        else:
            context_slots = None
            if start > 0:
                context_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start + n)])
            prefills.append(
                PrefillChunk(
                    query_start=len(ids) - n, query_len=n, context_len=start + n, context_slots=context_slots
                )
            )
    width = max((len(t) for t in decode_tables), default=0)
    meta = AttentionMetadata(
        num_tokens=len(ids),
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(decode_tables),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int64),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64),
        prefills=tuple(prefills),
    )
    return torch.tensor(ids), torch.tensor(pos), meta
