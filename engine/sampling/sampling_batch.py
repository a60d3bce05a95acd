"""One step's sampling work: the rows that need a token (`SamplingRow`), turned from per-request Python values into a
few tensors in one pass over them (`SamplingBatch`).

Absent stages are None: the builder does no tensor work for a stage no row needs, which is what keeps the common
steps (all greedy, all alike) cheap.

History stages (min_tokens, penalties) are sparse: flat (step row, token id) positions, so their cost grows with
the tokens involved, not with num_rows * vocab_size. The random stage and its filters run on row subsets, each a
`RowGroup` of its parent batch:

    step rows          0  1  2  3  4  5          temperature 0 at rows 1 and 4
    random rows        0  2  3  5                RowGroup(index=[0, 2, 3, 5]) of the step
    top_k rows         2  5    (step numbering)  RowGroup(index=[1, 3]) of the random rows

`index=None` means "every row of the parent, in order": a stage every row needs works on the parent tensor
itself, with no gather or scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_copy import to_device

from engine.request.sampling_params import SamplingParams
from engine.sampling.allowed_tokens import AllowedTokensStage
from engine.request.bad_words import banned_next_tokens
from engine.sampling.logit_bias import LogitBiasStage

# Temperatures below this are greedy: dividing logits by them would overflow float32 (vLLM uses the same cut).
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """One request that needs a token this step.

    `generator` is the request's own, seeded from `params.seed` by the caller and kept across steps; best on the
    logits' device (one elsewhere works, at the cost of a copy per step). None draws from the sampler's default
    generator. Token ids must be < vocab_size.
    min_tokens masking applies whatever `params.ignore_eos` says: ignore_eos only affects stopping, which is the
    engine's business.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]  # for the repetition penalty
    output_token_ids: Sequence[int]  # tokens generated so far: penalties and min_tokens
    eos_token_ids: tuple[int, ...]  # masked with params.stop_token_ids while len(output) < params.min_tokens
    bad_words_token_ids: Sequence[Sequence[int]] = ()  # params.bad_words tokenized (engine/request/bad_words.py)


@dataclass(frozen=True)
class RowGroup:
    """The rows of a parent batch that one stage applies to."""

    index: torch.Tensor | None  # [num_group_rows] int64 positions in the parent; None: every parent row

    # Advanced indexing rather than index_select / index_copy_: on a CPU shared with other work, index_select of
    # 40 rows x 49k took ~70 ms against ~15 ms for indexing (0.7 vs 1.3 ms idle); on GPU both are one kernel.
    def gather(self, parent: torch.Tensor) -> torch.Tensor:
        """This group's rows of `parent` ([num_parent_rows, ...]); the parent itself when the group is all rows."""
        return parent if self.index is None else parent[self.index]

    def scatter(self, parent: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Write this group's `rows` into `parent` (in place) and return it; `rows` itself when the group is all."""
        if self.index is None:
            return rows
        parent[self.index] = rows
        return parent


@dataclass(frozen=True)
class TokenPositions:
    """Flat (step row, token id) pairs: the sparse form of a selection in [num_rows, vocab_size]."""

    row_ids: torch.Tensor  # [num_positions] int64
    token_ids: torch.Tensor  # [num_positions] int64


@dataclass(frozen=True)
class RepetitionStage:
    penalty: torch.Tensor  # [num_rows] per step row; 1 where neutral
    seen: TokenPositions  # every prompt and output token of the penalised rows, duplicates included


@dataclass(frozen=True)
class FrequencyPresenceStage:
    frequency_penalty: torch.Tensor  # [num_rows] per step row; 0 where neutral
    presence_penalty: torch.Tensor  # [num_rows] per step row; 0 where neutral
    output: TokenPositions  # every output token of the penalised rows, duplicates included (they are counts)


@dataclass(frozen=True)
class FilterStage:
    """top_k or top_p for the random rows that set it."""

    rows: RowGroup  # of the random rows
    values: torch.Tensor  # [num_group_rows, 1] the filter's parameter per row
    max_value: float  # the largest of `values`, known without a device sync


@dataclass(frozen=True)
class RandomStage:
    """The rows with temperature > 0: scale, filter, then draw with each row's generator."""

    rows: RowGroup  # of the step
    temperature: torch.Tensor  # [num_random, 1]
    min_p: torch.Tensor | None  # [num_random, 1], 0 where unset; None: no row sets it
    top_k: FilterStage | None  # int64 values in [1, vocab_size)
    top_p: FilterStage | None  # values in (0, 1)
    seeded: list[tuple[int, torch.Generator]]  # (random row, its own generator)
    unseeded: RowGroup | None  # random rows drawing from the sampler's default generator; None: no such row


@dataclass(frozen=True)
class LogprobStage:
    """The rows that asked for logprobs, and how many top entries each wants."""

    rows: RowGroup  # of the step
    num_logprobs: list[int]  # per group row
    max_num_logprobs: int


@dataclass(frozen=True)
class SamplingBatch:
    """Everything the sampler needs for one step, beyond the logits."""

    num_rows: int
    vocab_size: int
    # -inf: EOS and stop ids of the rows still short of min_tokens, and the tokens their bad_words ban next
    masked_tokens: TokenPositions | None
    repetition: RepetitionStage | None
    frequency_presence: FrequencyPresenceStage | None
    greedy: RowGroup | None  # rows with temperature 0, of the step; None: no such row
    random: RandomStage | None  # None: every row is greedy
    logprobs: LogprobStage | None
    logit_bias: LogitBiasStage | None = None
    allowed_tokens: AllowedTokensStage | None = None

    @property
    def adjusts_logits(self) -> bool:
        """Whether a stage before the greedy/random split changes logits: min_tokens or bad_words, a bias, a
        penalty or a mask of allowed tokens."""
        return (self.masked_tokens is not None or self.repetition is not None or self.frequency_presence is not None
                or self.logit_bias is not None or self.allowed_tokens is not None)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingBatch:
        """Read every row's params once and build the tensors of the stages some row needs."""
        num_rows = len(rows)
        logprob_rows: list[int] = []
        num_logprobs: list[int] = []
        masked = _PositionsBuilder()
        repetition_rows: list[int] = []
        repetition: list[float] = []
        seen = _PositionsBuilder()
        frequency_presence_rows: list[int] = []
        frequency: list[float] = []
        presence: list[float] = []
        outputs = _PositionsBuilder()
        greedy_rows: list[int] = []
        random_rows: list[int] = []
        temperature: list[float] = []
        min_p_rows: list[int] = []
        min_p: list[float] = []
        top_k_rows: list[int] = []
        top_k: list[int] = []
        top_p_rows: list[int] = []
        top_p: list[float] = []
        seeded: list[tuple[int, torch.Generator]] = []
        unseeded: list[int] = []

        for row_id, row in enumerate(rows):
            params = row.params
            if params.logprobs is not None:
                logprob_rows.append(row_id)
                num_logprobs.append(params.logprobs)
            if len(row.output_token_ids) < params.min_tokens:
                # An id beyond the logits cannot be sampled anyway.
                stop_ids = [t for t in (*row.eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab_size]
                if stop_ids:
                    masked.add(row_id, stop_ids)
            if row.bad_words_token_ids:
                banned = [t for t in banned_next_tokens(row.bad_words_token_ids, row.output_token_ids)
                          if 0 <= t < vocab_size]
                if banned:
                    masked.add(row_id, banned)
            if params.repetition_penalty != 1.0:
                repetition_rows.append(row_id)
                repetition.append(params.repetition_penalty)
                seen.add(row_id, row.prompt_token_ids)
                seen.add(row_id, row.output_token_ids)
            if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
                frequency_presence_rows.append(row_id)
                frequency.append(params.frequency_penalty)
                presence.append(params.presence_penalty)
                outputs.add(row_id, row.output_token_ids)
            if params.temperature < MIN_TEMPERATURE:
                greedy_rows.append(row_id)
                continue  # the filters and the generator do not matter
            random_row = len(random_rows)
            random_rows.append(row_id)
            temperature.append(params.temperature)
            if params.min_p > 0.0:
                min_p_rows.append(random_row)
                min_p.append(params.min_p)
            if 0 < params.top_k < vocab_size:
                top_k_rows.append(random_row)
                top_k.append(params.top_k)
            if params.top_p < 1.0:
                top_p_rows.append(random_row)
                top_p.append(params.top_p)
            if row.generator is None:
                unseeded.append(random_row)
            else:
                seeded.append((random_row, row.generator))

        repetition_stage = None
        if repetition_rows:
            repetition_stage = RepetitionStage(
                penalty=_per_row(num_rows, 1.0, repetition_rows, repetition, device), seen=seen.build(device)
            )
        frequency_presence_stage = None
        if frequency_presence_rows:
            frequency_presence_stage = FrequencyPresenceStage(
                frequency_penalty=_per_row(num_rows, 0.0, frequency_presence_rows, frequency, device),
                presence_penalty=_per_row(num_rows, 0.0, frequency_presence_rows, presence, device),
                output=outputs.build(device),
            )
        random = None
        if random_rows:
            num_random = len(random_rows)
            random = RandomStage(
                rows=_group(random_rows, num_rows, device),
                temperature=to_device(torch.tensor(temperature, dtype=torch.float32), device).unsqueeze(1),
                min_p=_per_row(num_random, 0.0, min_p_rows, min_p, device).unsqueeze(1) if min_p_rows else None,
                top_k=_filter_stage(top_k_rows, top_k, num_random, torch.int64, device),
                top_p=_filter_stage(top_p_rows, top_p, num_random, torch.float32, device),
                seeded=seeded,
                unseeded=_group(unseeded, num_random, device) if unseeded else None,
            )
        logprobs = None
        if logprob_rows:
            logprobs = LogprobStage(_group(logprob_rows, num_rows, device), num_logprobs, max(num_logprobs))
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            masked_tokens=masked.build(device) if masked.row_ids else None,
            repetition=repetition_stage,
            frequency_presence=frequency_presence_stage,
            greedy=_group(greedy_rows, num_rows, device) if greedy_rows else None,
            random=random,
            logprobs=logprobs,
            logit_bias=LogitBiasStage.from_rows([row.params.logit_bias for row in rows], vocab_size, device),
            allowed_tokens=AllowedTokensStage.from_rows([row.params.allowed_token_ids for row in rows], vocab_size,
                                                        device),
        )


class _PositionsBuilder:
    """Collects TokenPositions row by row."""

    def __init__(self) -> None:
        self.row_ids: list[int] = []
        self.lengths: list[int] = []
        self.token_ids: list[int] = []

    def add(self, row_id: int, token_ids: Sequence[int]) -> None:
        self.row_ids.append(row_id)
        self.lengths.append(len(token_ids))
        self.token_ids.extend(token_ids)

    def build(self, device: torch.device) -> TokenPositions:
        # Row ids are expanded with numpy on the host: torch.repeat_interleave is a handful of CPU kernels, each
        # a parallel region, which costs more than the work on a busy machine; on GPU it is one copy either way.
        row_ids = np.repeat(np.asarray(self.row_ids, dtype=np.int64), np.asarray(self.lengths, dtype=np.int64))
        return TokenPositions(
            row_ids=to_device(torch.from_numpy(row_ids), device),  # [num_positions]
            token_ids=to_device(torch.tensor(self.token_ids, dtype=torch.int64), device),  # [num_positions]
        )


def _per_row(num_rows: int, neutral: float, rows: list[int], values: list[float], device: torch.device) -> torch.Tensor:
    """A [num_rows] float32 tensor holding `values` at `rows` and `neutral` elsewhere."""
    full = [neutral] * num_rows
    for row, value in zip(rows, values, strict=True):
        full[row] = value
    return to_device(torch.tensor(full, dtype=torch.float32), device)


def _group(positions: list[int], num_parent_rows: int, device: torch.device) -> RowGroup:
    if len(positions) == num_parent_rows:
        return RowGroup(None)
    return RowGroup(to_device(torch.tensor(positions, dtype=torch.int64), device))


def _filter_stage(
    rows: list[int], values: Sequence[float], num_parent_rows: int, dtype: torch.dtype, device: torch.device
) -> FilterStage | None:
    if not rows:
        return None
    column = to_device(torch.tensor(values, dtype=dtype), device).unsqueeze(1)  # [len(rows), 1]
    return FilterStage(_group(rows, num_parent_rows, device), column, max(values))
