"""The rejection sampler's output distribution equals the target's, checked by a chi-square test at significance
0.001, which the same test shows failing for deliberately broken acceptance rules.

One verification with drafts d0, d1 over fixed target logits at three positions (small vocabulary, so every outcome
is seen often) has these outcomes and exact probabilities, p_j the target's shaped distribution at position j:

    output [t]         t != d0     p0(t)
    output [d0, t]     t != d1     p0(d0) p1(t)
    output [d0, d1, t]             p0(d0) p1(d1) p2(t)         (t: the bonus token)

Many independent trials run as one batch (each trial a request of its own); the sampler's default generator is
seeded, so the test is deterministic.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from engine.request.sampling_params import SamplingParams
from engine.sampling import rejection_sampler
from engine.sampling.rejection_sampler import RejectionSampler, VerifyRequest
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import SamplingRow

VOCAB_SIZE = 8
NUM_TRIALS = 6_000
ALPHA = 0.001
Z_ALPHA = 3.0902  # the standard normal's 1 - ALPHA quantile


def chi2_critical(dof: int) -> float:
    """The chi-square distribution's 1 - ALPHA quantile (Wilson-Hilferty; within 1% for dof >= 3)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + Z_ALPHA * math.sqrt(h)) ** 3


def _logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, VOCAB_SIZE, generator=gen) * 1.2  # [positions, vocab]
    logits[0, 3] += 2.5  # d0 = 3 fairly likely, so that later positions are reached often
    logits[1, 5] += 3.0  # d1 = 5
    return logits


DRAFTS = [3, 5]


def _shaped_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The sampler's distribution per position: temperature, then top_k (no other filter is used here)."""
    scaled = logits.double() / params.temperature
    if params.top_k:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(dim=-1).numpy()


def _expected(probs: np.ndarray) -> dict[tuple[int, ...], float]:
    d0, d1 = DRAFTS
    cells = {(t,): probs[0, t] for t in range(VOCAB_SIZE) if t != d0}
    cells |= {(d0, t): probs[0, d0] * probs[1, t] for t in range(VOCAB_SIZE) if t != d1}
    cells |= {(d0, d1, t): probs[0, d0] * probs[1, d1] * probs[2, t] for t in range(VOCAB_SIZE)}
    return cells


def _trials(params: SamplingParams) -> Counter[tuple[int, ...]]:
    logits = _logits()
    requests = [
        VerifyRequest(
            rows=[SamplingRow(params, None, [], DRAFTS[:j], ()) for j in range(len(DRAFTS) + 1)],
            draft_token_ids=DRAFTS,
        )
        for _ in range(NUM_TRIALS)
    ]
    batch_logits = logits.repeat(NUM_TRIALS, 1)  # [NUM_TRIALS * 3, vocab]
    results = RejectionSampler(Sampler(seed=1234)).verify(batch_logits, requests)
    return Counter(tuple(r.token_ids) for r in results)


def fits(counts: Counter[tuple[int, ...]], expected_probs: dict[tuple[int, ...], float]) -> tuple[bool, str]:
    """Whether `counts` pass the chi-square test against `expected_probs` at ALPHA, and why."""
    impossible = set(counts) - {c for c, p in expected_probs.items() if p > 0}
    if impossible:
        return False, f"impossible outputs {sorted(impossible)[:3]}"
    statistic, dof = chi_square(counts, expected_probs)
    return statistic < chi2_critical(dof), f"chi-square {statistic:.1f}, critical {chi2_critical(dof):.1f}, {dof} dof"


def chi_square(counts: Counter[tuple[int, ...]], expected_probs: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """The statistic and its degrees of freedom; cells expected fewer than 5 times are pooled."""
    observed, expected = [], []
    pooled_observed = pooled_expected = 0.0
    for cell, p in expected_probs.items():
        if p * NUM_TRIALS >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(p * NUM_TRIALS)
        else:
            pooled_observed += counts.get(cell, 0)
            pooled_expected += p * NUM_TRIALS
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    o, e = np.array(observed), np.array(expected)
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


PARAMS = [
    pytest.param(SamplingParams(temperature=1.0), id="temperature-1"),
    pytest.param(SamplingParams(temperature=0.7, top_k=5), id="temperature-0.7-top-k-5"),
]


@pytest.mark.parametrize("params", PARAMS)
def test_output_distribution_is_the_targets(params: SamplingParams) -> None:
    counts = _trials(params)
    expected = _expected(_shaped_probs(_logits(), params))
    ok, why = fits(counts, expected)
    assert ok, why
    assert chi_square(counts, expected)[1] >= 10  # degrees of freedom: the test has power
    assert counts[tuple(DRAFTS[:1])] == 0  # a rejection never outputs the draft it rejected ...
    assert sum(n for c, n in counts.items() if len(c) == 3) > 500  # ... and bonus tokens are well covered


def _off_by_one(sampled: list[int], drafts: list[int]) -> list[int]:
    """Broken: compares each draft with the sample of the position after it."""
    num_accepted = 0
    while num_accepted < len(drafts) and sampled[num_accepted + 1] == drafts[num_accepted]:
        num_accepted += 1
    return [*drafts[:num_accepted], sampled[num_accepted]]


def _lenient(sampled: list[int], drafts: list[int]) -> list[int]:
    """Broken: accepts a draft that the target sampled at this position or the next one (too often)."""
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] in sampled[num_accepted : num_accepted + 2]:
        num_accepted += 1
    return [*drafts[:num_accepted], sampled[num_accepted]]


@pytest.mark.parametrize("broken_rule", [_off_by_one, _lenient])
@pytest.mark.parametrize("params", PARAMS)
def test_the_same_check_fails_for_a_broken_acceptance_rule(
    monkeypatch: pytest.MonkeyPatch, params: SamplingParams, broken_rule
) -> None:  # noqa: ANN001
    monkeypatch.setattr(rejection_sampler, "accept_drafts", broken_rule)
    ok, why = fits(_trials(params), _expected(_shaped_probs(_logits(), params)))
    assert not ok, f"the broken rule passed: {why}"


def test_greedy_accepts_while_the_argmax_matches() -> None:
    logits = _logits()
    greedy = SamplingParams(temperature=0.0)
    argmax = logits.argmax(dim=-1).tolist()

    def verify(drafts: list[int]) -> list[int]:
        rows = [SamplingRow(greedy, None, [], drafts[:j], ()) for j in range(len(drafts) + 1)]
        request = VerifyRequest(rows=rows, draft_token_ids=drafts)
        [result] = RejectionSampler(Sampler(seed=0)).verify(logits[: len(drafts) + 1], [request])
        return result.token_ids

    assert verify(argmax[:2]) == argmax  # both accepted, then the bonus argmax
    assert verify([argmax[0], (argmax[1] + 1) % VOCAB_SIZE]) == argmax[:2]
    assert verify([(argmax[0] + 1) % VOCAB_SIZE, argmax[1]]) == argmax[:1]
    assert verify([]) == argmax[:1]
