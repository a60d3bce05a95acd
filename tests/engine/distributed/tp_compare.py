"""Comparing an engine at TP N with one at TP 1 on the same workload: tokens, and the logits behind them.

`SampledLogits` records every logits row an engine's sampler is handed, keyed by the request's prompt and output so
far: one key on both engines means one input sequence, so its two rows differ only by the arithmetic (the
all-reduces' summation order). `assert_tp_matches` asserts the tokens equal, except where such rounding flips a
near-tie (the TP-1 top-two gap there within twice the measured difference), which it reports by prompt; and that
no row differs by more than the bound anywhere (1e-3 in float32).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

LOGIT_BOUND = 1e-3  # max |logit diff| between TP N and TP 1, float32


@dataclass
class SampledLogits:
    rows: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def install(cls, engine) -> SampledLogits:  # noqa: ANN001 - an LLMEngine
        recorded = cls()
        sampler = engine.runner.sampler
        launch = sampler.launch  # what the runner calls (sample is launch(...).result())

        def recording_launch(logits, rows, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            for row, values in zip(rows, logits, strict=True):
                recorded.rows[(tuple(row.prompt_token_ids), tuple(row.output_token_ids))] = values.detach().clone()
            return launch(logits, rows, *args, **kwargs)

        sampler.launch = recording_launch
        return recorded


def max_logit_diff(reference: SampledLogits, other: SampledLogits) -> tuple[float, int]:
    """The largest |difference| over the rows both saw, and how many rows that was."""
    common = reference.rows.keys() & other.rows.keys()
    diffs = [float((reference.rows[k] - other.rows[k]).abs().max()) for k in common]
    return max(diffs, default=0.0), len(common)


def assert_tp_matches(prompts: dict[str, list[int]], want: dict[str, list[int]], got: dict[str, list[int]],
                      reference: SampledLogits, other: SampledLogits, *, bound: float = LOGIT_BOUND) -> float:
    """`got` (TP N) equals `want` (TP 1) request by request (`prompts`: each request's prompt token ids), but for
    reported rounding flips of greedy tokens; every common logits row within `bound`. Returns the max |logit
    diff|."""
    diff, num_rows = max_logit_diff(reference, other)
    assert num_rows > 0, "no logits row in common: the comparison compared nothing"
    assert diff <= bound, f"max |logit diff| TP N vs TP 1 is {diff:.3g} over {num_rows} rows (bound {bound})"
    assert want.keys() == got.keys()
    flips = []
    for request_id in sorted(want):
        w, g = want[request_id], got[request_id]
        if w == g:
            continue
        k = next(i for i, (a, b) in enumerate(zip(w, g, strict=False)) if a != b)
        key = (tuple(prompts[request_id]), tuple(w[:k]))
        assert key in reference.rows and key in other.rows and int(reference.rows[key].argmax()) == w[k], (
            f"{request_id}: token {k} differs ({w} vs {g}) and is no greedy pick from a common logits row")
        top2 = reference.rows[key].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap <= 2 * diff, (f"{request_id}: token {k} differs ({w[k]} vs {g[k]}) but TP 1's top-two gap there is "
                                 f"{gap:.3g}, more than rounding ({diff:.3g}) can flip")
        flips.append(f"{request_id} at token {k} (top-two gap {gap:.3g})")
    if flips:
        warnings.warn(f"all-reduce rounding flipped near-ties: {'; '.join(flips)}; max |logit diff| {diff:.3g}",
                      stacklevel=2)
    return diff
