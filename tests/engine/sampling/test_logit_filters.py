"""The filters and penalties as pure functions, against float64 references written from their definitions."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from engine.sampling import logit_filters
from engine.sampling.logit_filters import min_p_threshold, top_k_threshold, top_p_threshold
from engine.sampling.penalties import apply_frequency_presence_penalties, apply_repetition_penalty, mask_tokens
from tests.engine.sampling.helpers import softmax

NEG_INF = float("-inf")


def kept(logits: torch.Tensor, threshold: torch.Tensor | None = None) -> list[set[int]]:
    """Per row, the token ids at or above `threshold` ([num_rows, 1]), or the finite ones without one."""
    alive = logits >= threshold if threshold is not None else logits > NEG_INF
    return [set(torch.nonzero(row).squeeze(1).tolist()) for row in alive]


def reference_nucleus(logits: np.ndarray, top_p: float) -> set[int]:
    probs = softmax(logits.astype(np.float64))
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    num_kept = int(np.searchsorted(cumulative, top_p)) + 1  # first index whose cumulative >= top_p, inclusive
    return set(order[:num_kept].tolist())


def test_min_p_keeps_tokens_within_ratio_of_the_max() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    threshold = min_p_threshold(logits, torch.tensor([[0.15], [1.0]]))
    # row 0: 0.15 * 0.5 = 0.075 -> keep 0.5, 0.3, 0.1; row 1: all tie with the max, min_p = 1 keeps them all
    assert kept(logits, threshold) == [{0, 1, 2}, {0, 1, 2, 3, 4}]


def test_min_p_zero_drops_nothing() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(min_p_threshold(logits, torch.zeros(3, 1)), torch.full((3, 1), NEG_INF))


def test_top_k_per_row_and_ties_kept() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 2.0, 2.0, 0.0, 3.0]])
    threshold = top_k_threshold(logits, torch.tensor([[2], [2]]), max_top_k=2)
    assert kept(logits, threshold) == [{1, 3}, {1, 2, 4}]  # row 1: the 2nd largest (2.0) is tied, both stay


def test_top_p_small_example() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3]]))
    threshold = top_p_threshold(logits, torch.tensor([[0.7], [0.4], [0.9]]))
    assert kept(logits, threshold) == [{1, 3}, {1}, {1, 2, 3}]


@pytest.mark.parametrize("num_candidates", [4, 256])
def test_top_p_matches_reference_with_and_without_full_sort(
    monkeypatch: pytest.MonkeyPatch, num_candidates: int
) -> None:
    # Peaked rows find their nucleus among the candidates; flat ones (nucleus > candidates) fall back to a sort.
    monkeypatch.setattr(logit_filters, "TOP_P_NUM_CANDIDATES", num_candidates)
    generator = torch.Generator().manual_seed(1)
    scales = torch.tensor([[0.05], [4.0], [0.5], [8.0]])
    logits = torch.randn(4, 400, generator=generator, dtype=torch.float64).float() * scales  # [4, 400]
    top_p = torch.tensor([[0.9], [0.8], [0.5], [0.95]])
    got = kept(logits, top_p_threshold(logits, top_p))
    for row in range(4):
        assert got[row] == reference_nucleus(logits[row].numpy(), float(top_p[row]))


def test_top_p_renormalises_over_the_floor() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    floor = top_k_threshold(logits, torch.tensor([[2], [4]]), max_top_k=4)  # row 0: 0.571, 0.429 after top_k
    threshold = top_p_threshold(logits, torch.tensor([[0.5], [0.5]]), floor)
    assert kept(logits, threshold) == [{0}, {0, 1}]
    # and never goes below the floor, even when the nucleus is everything above it
    threshold = top_p_threshold(logits, torch.tensor([[0.99], [0.99]]), floor)
    assert kept(logits, threshold) == [{0, 1}, {0, 1, 2, 3}]


def test_mask_tokens() -> None:
    logits = torch.zeros(2, 5)
    mask_tokens(logits, torch.tensor([0, 0, 1]), torch.tensor([1, 4, 2]))  # in place
    assert kept(logits) == [{0, 2, 3}, {0, 1, 3, 4}]


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], repetition: float, frequency: float, presence: float
) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in Counter(output).items():
        out[token] -= frequency * count + presence
    return out


def test_penalties_match_reference() -> None:
    generator = torch.Generator().manual_seed(2)
    vocab_size = 64
    logits = torch.randn(3, vocab_size, generator=generator) * 3  # [3, vocab_size], both signs
    histories = [([1, 2, 3, 3], [3, 5, 5, 5, 7]), ([], [9, 9]), ([4, 4, 10], [])]
    repetition = [1.3, 0.8, 2.0]
    frequency = [0.5, -0.4, 1.0]
    presence = [0.25, 1.5, -0.5]

    seen_rows = [r for r, (prompt, output) in enumerate(histories) for _ in [*prompt, *output]]
    seen_tokens = [t for prompt, output in histories for t in [*prompt, *output]]
    out_rows = [r for r, (_, output) in enumerate(histories) for _ in output]
    out_tokens = [t for _, output in histories for t in output]
    got = logits.clone()
    apply_repetition_penalty(got, torch.tensor(repetition), torch.tensor(seen_rows), torch.tensor(seen_tokens))
    apply_frequency_presence_penalties(
        got,
        torch.tensor(frequency),
        torch.tensor(presence),
        torch.tensor(out_rows, dtype=torch.int64),
        torch.tensor(out_tokens, dtype=torch.int64),
    )
    for row, (prompt, output) in enumerate(histories):
        expected = reference_penalties(
            logits[row].tolist(), prompt, output, repetition[row], frequency[row], presence[row]
        )
        torch.testing.assert_close(got[row], torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_sparse_penalties_equal_the_dense_formulas_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 32, generator=generator) * 4  # [2, 32]
    rows, tokens = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([5, 5, 7, 5, 9])
    rep, freq, pres = torch.tensor([1.7, 0.6]), torch.tensor([0.35, -0.7]), torch.tensor([0.45, 1.1])
    got = logits.clone()
    apply_repetition_penalty(got, rep, rows, tokens)
    apply_frequency_presence_penalties(got, freq, pres, rows, tokens)
    counts = torch.zeros_like(logits).index_put_((rows, tokens), torch.ones(5), accumulate=True)
    seen = counts > 0
    dense = torch.where(seen, torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits)
    dense = dense - freq[:, None] * counts - pres[:, None] * seen.float()
    assert torch.equal(got, dense)
