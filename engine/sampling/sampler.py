"""The sampler: one step's logits in, one token per request out, with vLLM v1's semantics.

Per row, each stage running only on the rows that need it (see `sampling_batch.py`):

    raw logits ─┬─▶ logprobs: log_softmax of the raw logits (what the model said, before any shaping)
                ▼
    masked: min_tokens' EOS and stop ids, bad_words' next tokens ─▶ logit_bias ─▶ repetition penalty
                ▼
    frequency & presence penalties ─▶ allowed_token_ids' mask
                ▼
    grammar bitmask (structured outputs: tokens the row's grammar rejects -> -inf, whole batch in one call; last,
    so no bias or penalty can bring back a token the grammar rejects; one still being filled on the grammar
    matchers' thread is waited for here, so everything before overlaps with its fill)
                │
                ├─ temperature 0 ─▶ argmax (ties -> lowest id)
                └─ otherwise ─────▶ / temperature ─▶ min_p ─▶ top_k ─▶ top_p ─▶ Gumbel-max draw

The draw is the exponential race in log space: with E_i ~ Exp(1) i.i.d., argmax_i p_i / E_i picks token i with
probability p_i, and argmax_i (logit_i - log E_i) is the same token without a softmax. E_i = -log U_i with U_i
uniform, drawn `vocab_size` at a time from the row's own generator when it has one. A seeded row therefore gets
the same token for the same logits wherever it sits in whatever batch: its noise depends only on its generator,
and every stage treats rows independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import HostCopy
from engine.request.logprobs import TokenLogprobs
from engine.sampling.logit_filters import min_p_threshold, top_k_threshold, top_p_threshold
from engine.sampling.penalties import apply_frequency_presence_penalties, apply_repetition_penalty, mask_tokens
from engine.sampling.sampling_batch import LogprobStage, RandomStage, SamplingBatch, SamplingRow
from engine.structured.bitmask import PendingBitmask, TokenBitmask, apply_token_bitmask, ready


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row, in row order
    logprobs: list[TokenLogprobs | None]  # one per row; None where params.logprobs is None


class LaunchedSample:
    """A step's tokens, sampled on the logits' device and on their way to the host (engine/host_copy.py):
    `token_ids` can feed the next step there before `result()` reads them back."""

    def __init__(self, token_ids: torch.Tensor, logprobs: _LogprobTensors | None, num_rows: int) -> None:
        self.token_ids = token_ids  # [num_rows] int64, where the logits were
        self._logprobs = logprobs
        self._num_rows = num_rows
        self._copy = HostCopy([token_ids, *(logprobs.tensors() if logprobs is not None else ())])
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        """The tokens (and logprobs) on the host: waits for the device as far as the sampling, once."""
        if self._result is None:
            host = self._copy.wait()
            logprobs: list[TokenLogprobs | None] = [None] * self._num_rows
            if self._logprobs is not None:
                self._logprobs.fill(host[1:], logprobs)
            self._result = SamplerOutput(token_ids=host[0].tolist(), logprobs=logprobs)
        return self._result


class Sampler:
    """Samples one token per row. Stateless between steps apart from the default generator."""

    def __init__(self, seed: int | None = None) -> None:
        """`seed` seeds the default generator (one per device, made on first use) for rows without their own;
        None seeds it nondeterministically."""
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow],
        token_bitmask: TokenBitmask | PendingBitmask | None = None,
    ) -> SamplerOutput:
        """Pick a token for each row; `token_bitmask` (structured outputs) limits the rows it names to the tokens
        their grammars allow (a pending one is waited for just before masking; its fill's error is raised here).

        logits: [num_rows, vocab_size], float32 (other float dtypes are processed in float32); not modified.
        Rows whose params agree share every tensor operation; the per-row Python work is reading params and
        building tensors, plus one noise draw per seeded random row.
        """
        return self.launch(logits, rows, token_bitmask).result()

    def launch(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow],
        token_bitmask: TokenBitmask | PendingBitmask | None = None,
    ) -> LaunchedSample:
        """`sample`, leaving the tokens on the logits' device: on a GPU nothing here waits for the device (the
        tensors the stages need are copied there asynchronously), and the host reads the tokens back when it asks
        for `result()`."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab_size], got {list(logits.shape)}")
        if not rows:
            return LaunchedSample(torch.empty(0, dtype=torch.int64, device=logits.device), None, 0)
        batch = SamplingBatch.from_rows(rows, vocab_size=logits.shape[1], device=logits.device)

        raw_logprobs = None
        if batch.logprobs is not None:  # before anything shapes the logits
            raw_logprobs = batch.logprobs.rows.gather(logits).float().log_softmax(dim=-1)  # [num_lp, vocab_size]

        if batch.adjusts_logits:
            logits = self._adjust(logits, batch)
        if token_bitmask is not None:  # after logit_bias and the penalties: the grammar has the last word
            if not batch.adjusts_logits:
                logits = logits.to(torch.float32, copy=True)  # the caller's logits stay untouched
            apply_token_bitmask(logits, ready(token_bitmask))

        if batch.random is None:
            token_ids = logits.argmax(dim=-1)  # [num_rows]: the all-greedy step is this one op
        elif batch.greedy is None:
            token_ids = self._sample_random(logits, batch.random)  # [num_rows]
        else:
            token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)  # [num_rows]
            assert batch.greedy.index is not None and batch.random.rows.index is not None  # both groups are partial
            token_ids[batch.greedy.index] = batch.greedy.gather(logits).argmax(dim=-1)
            token_ids[batch.random.rows.index] = self._sample_random(logits, batch.random)

        logprobs = None
        if batch.logprobs is not None and raw_logprobs is not None:
            logprobs = _LogprobTensors.gather(raw_logprobs, token_ids, batch.logprobs)
        return LaunchedSample(token_ids, logprobs, len(rows))

    @staticmethod
    def _adjust(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """min_tokens and bad_words masking, logit_bias, the penalties, then allowed_token_ids' mask, on a float32
        copy of logits [num_rows, vocab_size]."""
        logits = logits.to(torch.float32, copy=True)  # the caller's logits stay untouched
        if batch.masked_tokens is not None:
            mask_tokens(logits, batch.masked_tokens.row_ids, batch.masked_tokens.token_ids)
        if batch.logit_bias is not None:
            batch.logit_bias.apply(logits)
        if batch.repetition is not None:
            seen = batch.repetition.seen
            apply_repetition_penalty(logits, batch.repetition.penalty, seen.row_ids, seen.token_ids)
        if batch.frequency_presence is not None:
            stage = batch.frequency_presence
            apply_frequency_presence_penalties(
                logits, stage.frequency_penalty, stage.presence_penalty, stage.output.row_ids, stage.output.token_ids
            )
        if batch.allowed_tokens is not None:
            batch.allowed_tokens.apply(logits)
        return logits

    def _sample_random(self, logits: torch.Tensor, stage: RandomStage) -> torch.Tensor:
        """Draw one token per random row. logits: [num_rows, vocab_size] (the step's); returns [num_random]."""
        if stage.rows.index is None:
            scaled = logits.float() / stage.temperature  # [num_random, vocab_size], fresh: the caller's stays
        else:
            scaled = logits[stage.rows.index].float().div_(stage.temperature)  # a fresh copy
        threshold = _truncation_threshold(scaled, stage)  # [num_random, 1] or None
        if threshold is not None:
            scaled.masked_fill_(scaled < threshold, float("-inf"))
        return scaled.sub_(self._log_exponential_noise(scaled, stage)).argmax(dim=-1)

    def _log_exponential_noise(self, scaled: torch.Tensor, stage: RandomStage) -> torch.Tensor:
        """log E for E ~ Exp(1), shaped like `scaled` ([num_random, vocab_size]); each seeded row's from its own
        generator, the rest from the default one.

        E = -log U with U in [0, 1): U = 0 gives E = inf and a -inf score, never a NaN (unlike p / E at p = 0).
        """
        num_random, vocab_size = scaled.shape
        uniform = torch.empty_like(scaled)  # [num_random, vocab_size]
        if stage.unseeded is not None:
            default = self._default_generator(scaled.device)
            if stage.unseeded.index is None:
                uniform.uniform_(generator=default)
            else:
                num_unseeded = stage.unseeded.index.shape[0]
                draws = torch.rand(num_unseeded, vocab_size, generator=default, device=scaled.device)
                uniform[stage.unseeded.index] = draws
        for row, generator in stage.seeded:
            # Exactly vocab_size draws per step from the row's generator, whatever the batch looks like.
            if generator.device == uniform.device:
                uniform[row].uniform_(generator=generator)
            else:  # e.g. a CPU generator for GPU logits: draw where the generator lives, then copy
                uniform[row].copy_(torch.rand(vocab_size, generator=generator, device=generator.device))
        return uniform.log_().neg_().log_()

    def _default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._default_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._default_generators[device] = generator
        return generator


def _truncation_threshold(scaled: torch.Tensor, stage: RandomStage) -> torch.Tensor | None:
    """The smallest logit min_p, top_k and top_p (in that order) let through, per random row ([num_random, 1]);
    None when no row sets a filter. scaled: [num_random, vocab_size], temperature applied."""
    threshold = None
    if stage.min_p is not None:
        threshold = min_p_threshold(scaled, stage.min_p)
    if stage.top_k is not None:
        rows = stage.top_k.rows
        kth = top_k_threshold(rows.gather(scaled), stage.top_k.values, int(stage.top_k.max_value))
        if threshold is None:
            threshold = torch.full_like(scaled[:, :1], float("-inf"))
        threshold = rows.scatter(threshold, torch.maximum(rows.gather(threshold), kth))
    if stage.top_p is not None:
        rows = stage.top_p.rows
        floor = None if threshold is None else rows.gather(threshold)
        nucleus = top_p_threshold(rows.gather(scaled), stage.top_p.values, floor)
        if threshold is None:
            threshold = torch.full_like(scaled[:, :1], float("-inf"))
        threshold = rows.scatter(threshold, nucleus)
    return threshold


@dataclass
class _LogprobTensors:
    """The logprobs of a step's logprob rows, on the device until `fill` reads them on the host."""

    stage: LogprobStage
    row_ids: torch.Tensor | None  # [num_lp] the step rows; None: every row
    token_ids: torch.Tensor  # [num_lp] sampled
    token_logprobs: torch.Tensor  # [num_lp]
    ranks: torch.Tensor  # [num_lp], 1-based
    top_values: torch.Tensor | None  # [num_lp, max_num_logprobs], descending; None: no row wants any
    top_ids: torch.Tensor | None

    @classmethod
    def gather(cls, raw_logprobs: torch.Tensor, token_ids: torch.Tensor, stage: LogprobStage) -> _LogprobTensors:
        """raw_logprobs: [num_lp, vocab_size]; token_ids: [num_rows] sampled."""
        lp_token_ids = stage.rows.gather(token_ids)  # [num_lp]
        token_logprobs = raw_logprobs.gather(-1, lp_token_ids.unsqueeze(1))  # [num_lp, 1]
        ranks = (raw_logprobs >= token_logprobs).sum(dim=-1)  # [num_lp]; counts the token itself, so 1-based
        top_values = top_ids = None
        if stage.max_num_logprobs > 0:
            top_values, top_ids = raw_logprobs.topk(stage.max_num_logprobs, dim=-1)  # descending
        return cls(stage, stage.rows.index, lp_token_ids, token_logprobs.squeeze(1), ranks, top_values, top_ids)

    def tensors(self) -> list[torch.Tensor]:
        """What travels to the host, in the order `fill` takes it."""
        optional = [t for t in (self.row_ids, self.top_values, self.top_ids) if t is not None]
        return [self.token_ids, self.token_logprobs, self.ranks, *optional]

    def fill(self, host: Sequence[torch.Tensor], out: list[TokenLogprobs | None]) -> None:
        """Fill `out` at the stage's rows from the host copies of `tensors()`."""
        token_id_list, logprob_list, rank_list = (t.tolist() for t in host[:3])
        rest = list(host[3:])
        row_ids = range(len(out)) if self.row_ids is None else rest.pop(0).tolist()
        num_rows = len(self.stage.num_logprobs)
        top_values: list[list[float]] = [[] for _ in range(num_rows)]
        top_ids: list[list[int]] = [[] for _ in range(num_rows)]
        if self.top_values is not None:
            top_values, top_ids = rest[0].tolist(), rest[1].tolist()
        for i, row_id in enumerate(row_ids):
            num = self.stage.num_logprobs[i]
            out[row_id] = TokenLogprobs(
                token_id=token_id_list[i],
                logprob=logprob_list[i],
                rank=rank_list[i],
                top=list(zip(top_ids[i][:num], top_values[i][:num], strict=True)),
            )
