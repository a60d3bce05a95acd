"""Turns a scheduler step into one flattened forward pass and samples the requests that reached their end,
verifying their draft tokens (if any) in the same pass.

The runner owns the KV tensors (one per layer) and the per-request seeded generators; the control plane owns
the block ids that index them. It runs where the model's weights are: the KV cache is allocated there, and each
step's inputs are built on the host and copied there once, asynchronously (engine/host_copy.py).

`launch` queues a step on the device and returns it unread (engine/launched_step.py); `execute` is `launch` then
its `result()`. With async scheduling (engine/core/overlap.py) the engine launches step N+1 before reading step N:
N+1's placeholders (`ScheduledRequest.takes_last_sample`) are N's sampled tokens, copied into N+1's input ids on the
device, in stream order after N's sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.attention.int8_kv import Int8KVCache
from engine.attention.metadata import AttentionMetadata, PrefillChunk
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.host_copy import to_device
from engine.huge_pages import zeros_with_huge_pages
from engine.launched_step import LaunchedStep, StepResult
from engine.lora.lora_step import LoRAStep
from engine.model.llama import LlamaModel
from engine.request.logprobs import TokenLogprobs
from engine.sampling.prompt_logprobs import prompt_positions, prompt_token_logprobs
from engine.sampling.rejection_sampler import RejectionSampler, VerifyRequest
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import MIN_TEMPERATURE, SamplingRow
from engine.structured.bitmask import InFlightTokens, PendingBitmask, TokenBitmask

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphs
    from engine.structured.compiler import GrammarCompilerCache
    from engine.structured.matchers import GrammarMatchers

_PROMPT_LOGPROBS_SLICE = 256  # prompt positions whose logits are computed at once
PLACEHOLDER_TOKEN_ID = 0  # a placeholder's input id on the host, overwritten on the device before the forward


class ModelRunner:
    def __init__(
        self, model: LlamaModel, *, num_blocks: int, block_size: int, seed: int | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_cache, self.kv_scales, self.kv_caches = allocate_kv_cache(model, num_blocks, block_size, kv_cache_dtype)
        self.sampler = Sampler(seed=seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self._generators: dict[str, torch.Generator] = {}
        # Structured outputs: the requests' grammar matchers (use_grammars; None: no request may have one).
        self.grammars: GrammarMatchers | None = None
        self.graphs: DecodeGraphs | None = None  # the captured decode steps (cuda only; capture_cuda_graphs)
        self._last: LaunchedStep | None = None  # the step launched last: where placeholders come from
        self.uses_lora = False  # requests may run under LoRA adapters (--enable-lora): each step looks for them

    def use_grammars(self, compilers: GrammarCompilerCache) -> None:
        """Structured outputs from now on: the requests' grammar matchers, over grammars `compilers` compiled."""
        from engine.structured.matchers import GrammarMatchers

        self.grammars = GrammarMatchers(compilers, device=self.device)

    def skip_remote_draw(self, request: Request) -> None:
        """The request's first token was sampled on another worker (a prefill worker) from the same seed: start
        its generator here past that draw, so a seeded request samples on two workers what it samples on one."""
        params = request.sampling_params
        if params.seed is None or params.temperature < MIN_TEMPERATURE:
            return
        generator = self._new_generator(params.seed)
        # One draw of the sampler's: vocab_size float32 uniforms (rejection_sampler._replay_draws does the same).
        torch.empty(self.model.config.vocab_size, dtype=torch.float32, device=generator.device).uniform_(
            generator=generator)
        self._generators[request.request_id] = generator

    def _new_generator(self, seed: int) -> torch.Generator:
        """A seeded request's own generator, on the engine's device: on a GPU its draws stay there (one kernel per
        seeded row, no host copy; the rest of sampling is batched), as vLLM's do. A seed therefore gives the same
        tokens on engines of one device type; a CPU and a GPU engine draw different streams from it."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator and grammar matcher."""
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step. Returns, for each request that samples, its accepted draft tokens followed by the token
        sampled after them (one token when it has no drafts), and their logprobs where asked; and for each
        request that asked for prompt logprobs and computed prompt positions this step, (the first position,
        the logprobs of the tokens after each of them) — see engine/sampling/prompt_logprobs.py."""
        return self.launch(out).result()

    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue one step on the device; its `result()` is `execute`'s. A request that `takes_last_sample` gets,
        as its input token, the token the step launched before this one sampled for it."""
        if self._last is not None:  # its sampling, if deferred, goes first (and its reused logits are read); an
            self._last.finalize(quiet=True)  # error there fails its own readers, and this step if it takes its tokens
        items = step_order(out.scheduled)
        in_flight = self._in_flight_tokens(items)
        if self.grammars is not None:  # on cuda the step's grammar bitmask fill starts now, beside the forward
            self.grammars.start_fill(items, in_flight)
        feed = self._placeholder_feed(items)
        if self.graphs is not None and self._replayable(items):
            launched = self._replay(items, feed, in_flight)
        else:
            input_ids, positions, meta = prepare_step(items, self.block_size, self.device)
            if feed is not None:
                feed(input_ids)
            lora = LoRAStep.of(((item.request.lora, item.num_new_tokens) for item in items),  # type: ignore[misc]
                               self.device) if self.uses_lora else None
            hidden = (self.model.forward(input_ids, positions, self.kv_caches, meta) if lora is None else
                      self.model.forward(input_ids, positions, self.kv_caches, meta, lora))
            prompt_logprobs = self._prompt_logprobs(items, hidden)
            launched = self._sample(items, hidden, prompt_logprobs, in_flight)
        self._last = launched
        return launched

    def _in_flight_tokens(self, items: list[ScheduledRequest]) -> InFlightTokens | None:
        """For the structured requests of `items` whose last token the step before samples (async scheduling): what
        reads those tokens on the host (their grammar must accept them before it masks this step); None: none."""
        last = self._last
        if self.grammars is None or last is None:  # no structured request yet, or nothing in flight
            return None
        ids = [item.request.request_id for item in items
               if item.takes_last_sample and item.request.sampling_params.structured_outputs is not None]
        if not ids:
            return None
        return lambda: {request_id: last.token_of(request_id) for request_id in ids}

    def _placeholder_feed(self, items: list[ScheduledRequest]) -> Callable[[torch.Tensor], None] | None:
        """What writes the placeholders of `items` (in step order) into the step's flat input ids, from the last
        launched step's tokens on the device; None when the step has none."""
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        for item in items:
            offset += item.num_new_tokens
            if item.takes_last_sample:
                last = self._last
                row = None if last is None else last.row_of.get(item.request.request_id)
                if row is None or last is None or last.token_ids is None:
                    raise RuntimeError(f"request {item.request.request_id!r} takes a token the last step did not "
                                       "sample on the device")
                dst.append(offset - len(item.spec_token_ids) - 1)
                src.append(row)
        if not dst:
            return None
        assert self._last is not None and self._last.token_ids is not None
        tokens = self._last.token_ids  # [rows of the last step] int64, on the device

        def feed(input_ids: torch.Tensor) -> None:
            if dst == src == list(range(len(dst))):  # steady decode: the same requests in the same order
                input_ids[: len(dst)].copy_(tokens[: len(dst)])
                return
            index = to_device(torch.tensor([dst, src], dtype=torch.int64), input_ids.device)  # [2, num_placeholders]
            input_ids[index[0]] = tokens[index[1]]

        return feed

    def capture_cuda_graphs(self, *, max_seq_len: int, sizes: list[int]) -> float:
        """Capture the decode step for each batch size in `sizes`, over contexts of up to `max_seq_len` tokens (see
        engine/cuda_graphs.py); every later step of single-token decodes that fits one replays it. Returns the
        seconds capturing took."""
        from engine.cuda_graphs import DecodeGraphs

        assert self.kv_scales is None, "CUDA graphs need a KV cache in the model's dtype"
        # At tensor_parallel_size > 1, rank 0's shard is captured here and the TensorParallelModel has each child
        # capture its own (engine/distributed/tp_model.py).
        peers = self.model if hasattr(self.model, "replay_graph") else None
        model = self.model.local if peers is not None else self.model  # type: ignore[attr-defined]
        self.graphs = DecodeGraphs(model, self.kv_caches, block_size=self.block_size,  # type: ignore[arg-type]
                                   max_seq_len=max_seq_len, sizes=sizes, peers=peers)  # type: ignore[arg-type]
        return self.graphs.capture()

    def _replayable(self, items: list[ScheduledRequest]) -> bool:
        """A step a captured graph computes as eagerly: one new token per request within the graphs' context length,
        no drafts, no prompt logprobs, no LoRA adapter (graphs are captured for the base model)."""
        graphs = self.graphs
        assert graphs is not None
        return 0 < len(items) <= graphs.max_batch and all(
            item.num_new_tokens == 1 and not item.spec_token_ids and item.start < graphs.max_seq_len
            and item.request.sampling_params.prompt_logprobs is None and item.request.lora is None
            for item in items
        )

    def _replay(
        self, items: list[ScheduledRequest], feed: Callable[[torch.Tensor], None] | None,
        in_flight: InFlightTokens | None,
    ) -> LaunchedStep:
        assert self.graphs is not None
        positions = [item.start for item in items]
        logits = self.graphs.run(
            input_ids=[PLACEHOLDER_TOKEN_ID if item.takes_last_sample else item.request.all_token_ids[item.start]
                       for item in items],
            positions=positions,
            slots=[cache_slot(item.block_ids, item.start, self.block_size) for item in items],
            block_tables=[item.block_ids for item in items],
            feed=feed,
        )
        rows = [i for i, item in enumerate(items) if item.samples]
        if not rows:
            return LaunchedStep.done(({}, {}, {}))
        if len(rows) < len(items):
            logits = logits[to_device(torch.tensor(rows, dtype=torch.int64), logits.device)]
        return self._sample_logits([items[i] for i in rows], logits, {}, in_flight)

    def _prompt_logprobs(
        self, items: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        offset = 0
        for item in items:
            request = item.request
            num_top = request.sampling_params.prompt_logprobs
            chunk = prompt_positions(item.start, item.num_new_tokens, request.num_prompt_tokens)
            entries: list[TokenLogprobs] = []
            # A slice of positions at a time: [positions, vocab_size] float32 logits are large (50k floats each).
            for first in range(chunk.start, chunk.stop, _PROMPT_LOGPROBS_SLICE) if num_top is not None else ():
                last = min(first + _PROMPT_LOGPROBS_SLICE, chunk.stop)
                rows = hidden[offset + first - item.start : offset + last - item.start]  # [last - first, hidden]
                targets = request.prompt_token_ids[first + 1 : last + 1]
                entries += prompt_token_logprobs(self.model.compute_logits(rows), targets, num_top or 0)
            if entries:
                out[request.request_id] = (chunk.start, entries)
            offset += item.num_new_tokens
        return out

    def _sample(
        self, items: list[ScheduledRequest], hidden: torch.Tensor,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]], in_flight: InFlightTokens | None,
    ) -> LaunchedStep:
        logit_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        offset = 0
        for item in items:
            offset += item.num_new_tokens
            if item.samples:
                logit_rows.extend(range(offset - item.num_sample_positions, offset))
                sampling.append(item)
        if not sampling:
            return LaunchedStep.done(({}, {}, prompt_logprobs))
        if len(logit_rows) < hidden.shape[0]:
            hidden = hidden[to_device(torch.tensor(logit_rows, dtype=torch.int64), hidden.device)]
        logits = self.model.compute_logits(hidden)  # [num_sample_positions summed, vocab]
        return self._sample_logits(sampling, logits, prompt_logprobs, in_flight)

    def _sample_logits(
        self, sampling: list[ScheduledRequest], logits: torch.Tensor,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]], in_flight: InFlightTokens | None = None,
    ) -> LaunchedStep:
        """Tokens for `sampling` (the step's requests that sample, in step order) from their logits rows: on the
        device, unread, without drafts (launched once a bitmask still being filled is ready: `LaunchedStep.finalize`);
        verified on the host with them."""
        if not sampling:
            return LaunchedStep.done(({}, {}, prompt_logprobs))
        if not any(item.spec_token_ids for item in sampling):
            rows = [self._sampling_row(item) for item in sampling]
            bitmask = self._grammar_bitmask(sampling, in_flight)
            request_ids = [item.request.request_id for item in sampling]
            if isinstance(bitmask, PendingBitmask):
                return LaunchedStep(request_ids=request_ids, prompt_logprobs=prompt_logprobs,
                                    deferred=lambda: self.sampler.launch(logits, rows, bitmask))
            return LaunchedStep(request_ids=request_ids, sample=self.sampler.launch(logits, rows, bitmask),
                                prompt_logprobs=prompt_logprobs)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
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
        return LaunchedStep.done((sampled, logprobs, prompt_logprobs))

    def _grammar_bitmask(self, sampling: list[ScheduledRequest], in_flight: InFlightTokens | None
                         ) -> TokenBitmask | PendingBitmask | None:
        """The grammar masks of the structured requests among `sampling` (one logits row each), or None."""
        structured = [i for i, item in enumerate(sampling) if item.request.sampling_params.structured_outputs]
        if not structured:
            return None
        assert self.grammars is not None, "a structured request reached an engine without grammar support"
        return self.grammars.fill([sampling[i].request for i in structured], structured, in_flight)

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
                generator = self._new_generator(params.seed)
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
            bad_words_token_ids=request.bad_words_token_ids,
        )


def allocate_kv_cache(
    model: LlamaModel, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor] | list[Int8KVCache]]:
    """A zeroed paged KV cache for `model`, where its weights are: (every layer's KV in one tensor, the int8 scales
    or None, the per-layer caches the model's forward takes).

    One tensor for all layers, so that one block across all layers (what a KV handoff moves) is read or written in
    a single strided copy: kv_cache[:, :, block_id] is [num_layers, 2, block_size, Hkv, D]. Per layer
    [2, num_blocks, block_size, Hkv, D], contiguous; an int8 cache's layers carry their scales
    ([num_layers, 2, num_blocks, Hkv] float32)."""
    c = model.config
    shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    kv_dtype = {"auto": model.dtype, "int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}[kv_cache_dtype]
    if model.device.type == "cpu":
        kv_cache = zeros_with_huge_pages(*shape, dtype=kv_dtype)
    else:
        kv_cache = torch.zeros(shape, dtype=kv_dtype, device=model.device)
    if kv_cache_dtype != "int8":
        return kv_cache, None, list(kv_cache.unbind(0))
    scales = torch.zeros(c.num_layers, 2, num_blocks, c.num_kv_heads, device=model.device)
    return kv_cache, scales, [Int8KVCache(data, s) for data, s in zip(kv_cache.unbind(0), scales.unbind(0),
                                                                       strict=True)]


def step_order(items: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Decodes first, shortest context first (the attention backend groups them by length); then prefills and
    draft verifications (several tokens after a cached context: the same attention as a prefill chunk)."""
    return sorted(items, key=lambda s: (s.num_new_tokens != 1, s.start if s.num_new_tokens == 1 else 0))


def cache_slot(block_table: list[int], position: int, block_size: int) -> int:
    """Where the K/V of the token at `position` goes in the paged cache: its block's slots, then its offset."""
    return block_table[position // block_size] * block_size + position % block_size


def prepare_step(
    items: list[ScheduledRequest], block_size: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids, positions and attention metadata of `items` (in `step_order`), flattened in that order, on
    `device` (default: the CPU), built on the host and copied once."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    prefill_tables: list[list[int]] = []
    for item in items:
        start, n, table = item.start, item.num_new_tokens, item.block_ids
        ids.extend(item.request.all_token_ids[start : start + n - len(item.spec_token_ids)])
        if item.takes_last_sample:
            ids.append(PLACEHOLDER_TOKEN_ID)  # the last step's token for it, written on the device (launch)
        ids.extend(item.spec_token_ids)
        positions = range(start, start + n)
        pos.extend(positions)
        slots.extend(cache_slot(table, p, bs) for p in positions)
        if n == 1:
            decode_tables.append(table)
            decode_lens.append(start + 1)
        else:
            context_slots = None
            if start > 0:
                context_slots = _to(torch.tensor([cache_slot(table, p, bs) for p in range(start + n)]), device)
            prefill_tables.append(table)
            prefills.append(
                PrefillChunk(
                    query_start=len(ids) - n, query_len=n, context_len=start + n, context_slots=context_slots
                )
            )
    meta = AttentionMetadata(
        num_tokens=len(ids),
        slot_mapping=_to(torch.tensor(slots), device),
        num_decode_tokens=len(decode_tables),
        decode_block_tables=_to(_padded(decode_tables), device),
        decode_seq_lens=_to(torch.tensor(decode_lens, dtype=torch.int64), device),
        prefills=tuple(prefills),
        prefill_block_tables=_to(_padded(prefill_tables), device),
    )
    return _to(torch.tensor(ids), device), _to(torch.tensor(pos), device), meta


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [len(tables), longest] int64 tensor, padded with block 0 (never read past a length)."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def _to(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return to_device(tensor, device)  # through pinned memory: the host never waits for a step in flight
