"""vLLM's allowed_token_ids: a hard mask after every other shaping, per row, greedy and sampled alike; logprobs stay
the model's raw ones; the caller's logits untouched."""

from __future__ import annotations

import math

import torch

from engine.request.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler
from tests.engine.sampling.helpers import make_row


def test_only_the_allowed_tokens_are_sampled_in_their_rows() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 2.5]] * 3)  # argmax 1 in every row
    rows = [
        make_row(SamplingParams(temperature=0.0, allowed_token_ids=[0, 2], logprobs=0)),  # 2 beats 0
        make_row(SamplingParams(temperature=0.0)),  # no mask: untouched by the others'
        make_row(SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[3, 4], logit_bias={1: 100.0})),
    ]
    sampler = Sampler(seed=0)
    out = sampler.sample(logits, rows)
    assert out.token_ids[:2] == [2, 1] and out.token_ids[2] in (3, 4)  # a bias cannot lift a masked token
    raw = logits[0].log_softmax(dim=-1)
    assert out.logprobs[0] is not None and math.isclose(out.logprobs[0].logprob, raw[2].item(), abs_tol=1e-6)
    assert logits[0, 1] == 3.0  # the caller's logits are not modified
    hot = make_row(SamplingParams(temperature=5.0, allowed_token_ids=[0, 3]))
    draws = {sampler.sample(logits[:1], [hot]).token_ids[0] for _ in range(200)}
    assert draws == {0, 3}  # a hot temperature spreads over the allowed tokens, and only over them
