"""Shared helpers for the sampler tests: row construction, repeated draws and a chi-square check."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.request.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import SamplingRow


def make_row(
    params: SamplingParams | None = None,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: tuple[int, ...] = (),
    seeded: bool = True,
) -> SamplingRow:
    """A row whose generator is seeded from params.seed (as the engine does) when it has one and `seeded`."""
    params = params if params is not None else SamplingParams()
    generator = None
    if seeded and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, generator, list(prompt), list(output), eos)


def draw_counts(
    logits_row: torch.Tensor,
    params: SamplingParams,
    num_draws: int,
    seed: int = 0,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> np.ndarray:
    """Sample `num_draws` independent tokens for one row of logits ([vocab_size]) in one batch; token counts."""
    vocab_size = logits_row.shape[0]
    logits = logits_row.unsqueeze(0).expand(num_draws, vocab_size)  # [num_draws, vocab_size]
    rows = [SamplingRow(params, None, list(prompt), list(output), ()) for _ in range(num_draws)]
    token_ids = Sampler(seed=seed).sample(logits, rows).token_ids
    return np.bincount(np.asarray(token_ids), minlength=vocab_size)


def assert_matches_distribution(counts: np.ndarray, probs: np.ndarray, num_sigma: float = 5.0) -> None:
    """Chi-square goodness of fit, tolerant: the statistic must be within `num_sigma` standard deviations
    (sqrt(2 * dof)) of its mean (dof). Tokens with zero reference probability must never be drawn; tokens
    expected fewer than 5 times are pooled into one bin, as the chi-square approximation needs."""
    probs = np.asarray(probs, dtype=np.float64)
    allowed = probs > 0
    assert counts[~allowed].sum() == 0, f"drew disallowed tokens {np.nonzero(counts * ~allowed)[0].tolist()}"
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    observed_bins, expected_bins = list(counts[big]), list(expected[big])
    tail_observed, tail_expected = counts[allowed & ~big].sum(), expected[allowed & ~big].sum()
    if tail_expected >= 5:
        observed_bins.append(tail_observed)
        expected_bins.append(tail_expected)
    elif expected_bins:  # too little to stand alone: fold it into a neighbour
        observed_bins[-1] += tail_observed
        expected_bins[-1] += tail_expected
    assert len(expected_bins) >= 2, "test design: the distribution has a single bin"
    statistic = float(((np.array(observed_bins) - np.array(expected_bins)) ** 2 / np.array(expected_bins)).sum())
    dof = len(expected_bins) - 1
    assert statistic < dof + num_sigma * np.sqrt(2 * dof), f"chi-square {statistic:.1f} with {dof} dof"


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()
