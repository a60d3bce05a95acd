"""logit_bias in the sampler: added to the named tokens' logits of its own row only, greedy and random rows alike,
before the penalties; logprobs stay the model's raw ones."""

from __future__ import annotations

import math

import torch

from engine.request.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler
from tests.engine.sampling.helpers import make_row


def test_bias_removes_forces_and_stays_in_its_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)  # argmax 1 in every row
    rows = [
        make_row(SamplingParams(temperature=0.0, logit_bias={1: -100.0}, logprobs=0)),  # the argmax removed: 3
        make_row(SamplingParams(temperature=0.7, seed=1, logit_bias={0: 100.0})),  # forced, even when sampled
        make_row(SamplingParams(temperature=0.0)),  # no bias: untouched by the others'
    ]
    out = Sampler(seed=0).sample(logits, rows)
    assert out.token_ids == [3, 0, 1]
    raw = logits[0].log_softmax(dim=-1)
    assert out.logprobs[0] is not None and math.isclose(out.logprobs[0].logprob, raw[3].item(), abs_tol=1e-6)
    assert logits[0, 1] == 3.0  # the caller's logits are not modified


def test_bias_runs_before_the_repetition_penalty() -> None:
    # vLLM's order. Token 2 (a prompt token, logit -1) biased by +4 to 3, then penalised: 3 / 2 = 1.5 < token 1's 1.8.
    # Penalised first it would win: -1 * 2 + 4 = 2 > 1.8.
    logits = torch.tensor([[0.0, 1.8, -1.0, 0.5]])
    row = make_row(SamplingParams(temperature=0.0, logit_bias={2: 4.0}, repetition_penalty=2.0), prompt=[2])
    assert Sampler(seed=0).sample(logits, [row]).token_ids == [1]
