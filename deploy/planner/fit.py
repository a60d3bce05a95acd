"""Least-squares fits of measured times to small linear models with non-negative coefficients, in pure Python
(the planner imports no numpy or torch).

    fit_nonnegative(rows, times)  ->  coefficients c >= 0 minimising  sum_i ((rows[i] . c - times[i]) / times[i])^2

The error is relative (each point weighted by 1/time), so that a 10 ms point counts as much as a 2 s one. Non-
negativity is had by trying every subset of the features (a model has three at most) and keeping the best
solution whose coefficients are all >= 0; a feature left out gets 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def _least_squares(rows: Sequence[Sequence[float]], times: Sequence[float], keep: Sequence[int]) -> list[float] | None:
    weighted = [[row[k] / t for k in keep] for row, t in zip(rows, times, strict=True)]
    target = [1.0] * len(times)  # times[i] / times[i]
    m = len(keep)
    # Scale each column to unit size so that features of very different magnitudes (1 and n * context) solve well.
    scale = [max(abs(r[j]) for r in weighted) or 1.0 for j in range(m)]
    scaled = [[r[j] / scale[j] for j in range(m)] for r in weighted]
    normal = [[sum(r[i] * r[j] for r in scaled) for j in range(m)] for i in range(m)]
    rhs = [sum(r[i] * y for r, y in zip(scaled, target, strict=True)) for i in range(m)]
    solution = _solve(normal, rhs)
    return None if solution is None else [s / scale[j] for j, s in enumerate(solution)]


def fit_nonnegative(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    """Coefficients (one per feature of `rows`), all >= 0, fitting `times` (all > 0) in relative error.
    Raises ValueError when there are no points or a time is not positive."""
    if not rows:
        raise ValueError("no points to fit")
    if min(times) <= 0:
        raise ValueError(f"times must be positive, got {min(times)}")
    num_features = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for size in range(num_features, 0, -1):
        for keep in itertools.combinations(range(num_features), size):
            solution = _least_squares(rows, times, keep)
            if solution is None or min(solution) < 0:
                continue
            coefficients = [0.0] * num_features
            for k, value in zip(keep, solution, strict=True):
                coefficients[k] = value
            error = sum((sum(c * x for c, x in zip(coefficients, row, strict=True)) / t - 1.0) ** 2
                        for row, t in zip(rows, times, strict=True))
            if best is None or error < best[0] - 1e-15:
                best = (error, coefficients)
    if best is None:  # every subset singular: the mean time as a constant, if the first feature is one
        return [sum(times) / len(times)] + [0.0] * (num_features - 1)
    return best[1]
