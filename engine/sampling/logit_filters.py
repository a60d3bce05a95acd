"""The truncation filters of random sampling: min_p, top_k, top_p, each as a per-row threshold logit.

Every filter answers "the smallest logit this row lets through"; the sampler drops tokens strictly below the
final threshold once, at the draw. Thresholds compose: top_k run on min_p's survivors keeps
max(min_p threshold, k-th largest logit), and top_p is computed over the survivors of both (`floor`), as vLLM
orders them (min_p -> top_k -> top_p). Thresholding keeps every token tied at a cut-off, so which of two equal
logits survives never depends on sort order. Each filter keeps the most likely token, and a row's threshold
depends on that row alone, which the sampler's seeded determinism relies on.
"""

from __future__ import annotations

import torch

# top_p first looks for each row's nucleus among its most likely tokens; only rows whose nucleus is wider than
# this fall back to a full sort. On CPU a full sort of a 50k vocabulary costs ~20x a top-256 selection, and the
# nucleus of a real LM distribution is usually a few dozen tokens.
TOP_P_NUM_CANDIDATES = 256


def min_p_threshold(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Threshold dropping tokens whose probability is below `min_p` times the row's largest probability.

    logits: [num_rows, vocab_size]; min_p: [num_rows, 1] in [0, 1] (0 drops nothing). Returns [num_rows, 1].
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax is needed.
    """
    return logits.amax(dim=-1, keepdim=True) + min_p.log()


def top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Threshold keeping each row's `top_k` most likely tokens (and any token tied with the k-th).

    logits: [num_rows, vocab_size]; top_k: [num_rows, 1] int64 in [1, vocab_size]; max_top_k: its largest
    value, passed in so no device sync is needed. Returns [num_rows, 1].
    """
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    return top_values.gather(-1, top_k - 1)


def top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Threshold keeping each row's nucleus: the fewest most likely tokens whose probabilities sum to >= top_p.

    logits: [num_rows, vocab_size]; top_p: [num_rows, 1] in (0, 1]; floor: [num_rows, 1], the threshold of the
    filters that ran before (tokens below it have probability 0 here and the rest are renormalised), or None.
    Returns [num_rows, 1], never below `floor`. The top token is always kept:

        sorted probs    0.50  0.30  0.15  0.05       top_p = 0.7
        cumulative      0.50  0.80  0.95  1.00
        below top_p     yes   no    no    no   ->  1 token below, keep 1 + 1 = 2 (the one that crosses is in)
    """
    vocab_size = logits.shape[-1]
    if floor is not None:
        logits = logits.masked_fill(logits < floor, float("-inf"))  # [num_rows, vocab_size]
    log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [num_rows, 1]
    num_candidates = min(TOP_P_NUM_CANDIDATES, vocab_size)
    candidates = logits.topk(num_candidates, dim=-1).values  # [num_rows, num_candidates], descending
    threshold, found = _nucleus_threshold(candidates, log_norm, top_p)  # [num_rows, 1], [num_rows]
    if num_candidates < vocab_size and not bool(found.all()):
        # A flat row: its nucleus is wider than the candidates, so sort that row in full.
        wide = (~found).nonzero().squeeze(1)  # [num_wide]
        sorted_logits = logits[wide].sort(dim=-1, descending=True).values  # [num_wide, vocab]
        wide_threshold, _ = _nucleus_threshold(sorted_logits, log_norm[wide], top_p[wide])
        threshold[wide] = wide_threshold
    return threshold if floor is None else torch.maximum(threshold, floor)


def _nucleus_threshold(
    sorted_logits: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest logit in each row's nucleus, looking only at the row's `n` largest logits.

    sorted_logits: [num_rows, n] descending; log_norm: [num_rows, 1], the log-sum-exp of the whole row.
    Returns (threshold [num_rows, 1], found [num_rows] bool). Where the n tokens do not reach top_p, found is
    False and threshold is the n-th logit; when n is the whole vocabulary that only happens through rounding,
    and keeping every token is then the right answer.
    """
    n = sorted_logits.shape[-1]
    cumulative = (sorted_logits - log_norm).exp_().cumsum_(dim=-1)  # [num_rows, n]
    num_below = (cumulative < top_p).sum(dim=-1, keepdim=True)  # [num_rows, 1]
    found = (num_below < n).squeeze(1)  # [num_rows]
    threshold = sorted_logits.gather(-1, num_below.clamp_(max=n - 1))  # [num_rows, 1]
    return threshold, found
