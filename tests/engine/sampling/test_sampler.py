"""The sampler end to end: greedy, penalties, filters, temperature, seeds, min_tokens, logprobs, mixed batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.request.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import SamplingRow
from tests.engine.sampling.helpers import assert_matches_distribution, draw_counts, make_row, softmax

VOCAB_SIZE = 300


def random_logits(num_rows: int, vocab_size: int = VOCAB_SIZE, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale  # [num_rows, vocab_size]


# --- greedy -----------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = random_logits(16)
    before = logits.clone()
    out = Sampler().sample(logits, [make_row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, before)


def test_greedy_ties_pick_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
    assert Sampler().sample(logits, [make_row(SamplingParams(temperature=0.0))] * 2).token_ids == [1, 0]


@pytest.mark.parametrize(
    ("logits", "params", "prompt", "output", "expected"),
    [
        # repetition divides a positive logit: 3.0 / 2 = 1.5 < 2.5
        ([3.0, 2.5, 0.0, -0.5], SamplingParams(repetition_penalty=2.0), [0], [], 1),
        # ... and multiplies a negative one: -1.0 * 1.5 = -1.5 < -1.2 (dividing would have kept token 0 on top)
        ([-1.0, -1.2, -5.0, -5.0], SamplingParams(repetition_penalty=1.5), [0], [], 1),
        # ... and covers output tokens too
        ([3.0, 2.5, 0.0, -0.5], SamplingParams(repetition_penalty=2.0), [], [0], 1),
        # frequency counts output occurrences (2.0 - 2 * 0.3 = 1.4 < 1.5), never prompt ones (token 1 untouched)
        ([2.0, 1.5, 0.0, 0.0], SamplingParams(frequency_penalty=0.3), [1, 1, 1, 1, 1], [0, 0], 1),
        # presence is paid once, whatever the count: 2.0 - 0.3 = 1.7 > 1.5
        ([2.0, 1.5, 0.0, 0.0], SamplingParams(presence_penalty=0.3), [], [0, 0, 0], 0),
        ([2.0, 1.5, 0.0, 0.0], SamplingParams(presence_penalty=0.6), [], [0, 0, 0], 1),
        # all three, in order: token 0: 2.0 / 1.25 = 1.6, - 0.1 * 1 - 0.05 = 1.45 < 1.5
        (
            [2.0, 1.5, 0.0, 0.0],
            SamplingParams(repetition_penalty=1.25, frequency_penalty=0.1, presence_penalty=0.05),
            [],
            [0],
            1,
        ),
        # a negative presence penalty rewards repeats: 1.5 + 1.0 = 2.5 > 2.0
        ([2.0, 1.5, 0.0, 0.0], SamplingParams(presence_penalty=-1.0), [], [1], 1),
    ],
)
def test_greedy_with_penalties_hand_computed(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int], expected: int
) -> None:
    params.temperature = 0.0
    penalised = make_row(params, prompt=prompt, output=output)
    plain = make_row(SamplingParams(temperature=0.0), prompt=prompt, output=output)
    batch = torch.tensor([logits, logits])
    # The neighbouring unpenalised row checks that penalties stay on their own row.
    assert Sampler().sample(batch, [penalised, plain]).token_ids == [expected, int(np.argmax(logits))]


def test_greedy_with_penalties_against_reference_on_random_histories() -> None:
    num_rows = 12
    logits = random_logits(num_rows, scale=1.0)
    rng = np.random.default_rng(0)
    rows, expected = [], []
    for row_id in range(num_rows):
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=float(rng.choice([1.0, 1.2, 1.8])),
            frequency_penalty=float(rng.choice([0.0, 0.5, -0.3])),
            presence_penalty=float(rng.choice([0.0, 0.7])),
        )
        prompt = rng.integers(0, VOCAB_SIZE, 20).tolist()
        # Outputs revisit the row's most likely tokens, so the penalties change the winner.
        top = torch.topk(logits[row_id], 5).indices.tolist()
        output = [int(t) for t in rng.choice(top, 6)] + rng.integers(0, VOCAB_SIZE, 4).tolist()
        rows.append(make_row(params, prompt=prompt, output=output))
        reference = logits[row_id].double().numpy().copy()
        for token in set(prompt) | set(output):
            rp = params.repetition_penalty
            reference[token] = reference[token] / rp if reference[token] > 0 else reference[token] * rp
        for token in output:
            reference[token] -= params.frequency_penalty
        for token in set(output):
            reference[token] -= params.presence_penalty
        expected.append(int(np.argmax(reference)))
    assert Sampler().sample(logits, rows).token_ids == expected
    assert expected != logits.argmax(dim=-1).tolist()  # the test would be vacuous otherwise


# --- filters and temperature --------------------------------------------------------------------------------------


def allowed_set(logits: np.ndarray, params: SamplingParams) -> set[int]:
    """The tokens that survive temperature, min_p, top_k then top_p, in float64."""
    probs = softmax(logits.astype(np.float64) / params.temperature)
    alive = np.ones_like(probs, dtype=bool)
    if params.min_p > 0:
        alive &= probs >= params.min_p * probs.max()
    if params.top_k > 0:
        alive &= probs >= np.sort(probs)[-params.top_k]
    if params.top_p < 1:
        renormalised = np.where(alive, probs, 0.0) / probs[alive].sum()
        order = np.argsort(-renormalised, kind="stable")
        num_kept = int(np.searchsorted(np.cumsum(renormalised[order]), params.top_p)) + 1
        alive &= np.isin(np.arange(len(probs)), order[:num_kept])
    return set(np.nonzero(alive)[0].tolist())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.7, min_p=0.05, top_k=20, top_p=0.8),
        SamplingParams(temperature=3.0, top_p=0.5),
        SamplingParams(temperature=10.0, top_p=0.95),  # nucleus wider than top_p's candidates: a full sort
    ],
    ids=["top_k", "top_p", "min_p", "all_three", "hot_top_p", "wide_top_p"],
)
def test_filtered_draws_stay_in_the_allowed_set(params: SamplingParams) -> None:
    logits_row = random_logits(1, vocab_size=VOCAB_SIZE, scale=2.0, seed=3)[0]
    allowed = allowed_set(logits_row.numpy(), params)
    assert 1 < len(allowed) < VOCAB_SIZE  # the filter bites and still leaves a choice
    counts = draw_counts(logits_row, params, num_draws=3000)
    drawn = set(np.nonzero(counts)[0].tolist())
    assert drawn <= allowed
    assert len(drawn) >= 0.9 * len(allowed)  # and the draws cover it


def test_filters_apply_in_order_min_p_top_k_top_p() -> None:
    # probs 0.4, 0.3, 0.2, 0.1. top_k=2 leaves 0.571 / 0.429, and top_p=0.5 is met by token 0 alone; top_p on
    # the un-renormalised probs would have kept two tokens.
    logits_row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    counts = draw_counts(logits_row, SamplingParams(top_k=2, top_p=0.5), num_draws=500)
    assert counts.tolist() == [500, 0, 0, 0]
    # min_p runs after temperature: at T=0.5 the probs are 0.53, 0.30, 0.13, 0.03, so min_p=0.3 drops 2 and 3
    # (at T=1 it would keep token 2: 0.2 >= 0.3 * 0.4).
    counts = draw_counts(logits_row, SamplingParams(temperature=0.5, min_p=0.3), num_draws=500)
    assert counts[2:].sum() == 0 and counts[:2].min() > 0


def test_top_k_top_p_min_p_distribution_matches_renormalised_reference() -> None:
    vocab_size = 40
    logits_row = random_logits(1, vocab_size=vocab_size, scale=1.5, seed=4)[0]
    params = SamplingParams(temperature=0.8, min_p=0.02, top_k=15, top_p=0.9)
    allowed = allowed_set(logits_row.numpy(), params)
    probs = softmax(logits_row.double().numpy() / params.temperature)
    reference = np.where(np.isin(np.arange(vocab_size), list(allowed)), probs, 0.0)
    counts = draw_counts(logits_row, params, num_draws=20000)
    assert_matches_distribution(counts, reference)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution(temperature: float) -> None:
    vocab_size = 30
    logits_row = random_logits(1, vocab_size=vocab_size, scale=1.0, seed=5)[0]
    counts = draw_counts(logits_row, SamplingParams(temperature=temperature), num_draws=20000)
    reference = softmax(logits_row.double().numpy() / temperature)
    assert_matches_distribution(counts, reference)
    if temperature != 1.0:  # and the check has the power to tell temperatures apart
        with pytest.raises(AssertionError):
            assert_matches_distribution(counts, softmax(logits_row.double().numpy()))


def test_penalties_shape_the_sampled_distribution() -> None:
    logits_row = torch.log(torch.tensor([0.7, 0.1, 0.1, 0.1]))
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.5)
    counts = draw_counts(logits_row, params, num_draws=20000, prompt=[1], output=[0])
    # token 0: log 0.7 is negative, so it is multiplied by 1.5, then 1.0 is subtracted; token 1: * 1.5 only
    penalised = logits_row.double().numpy().copy()
    penalised[0] = penalised[0] * 1.5 - 1.0
    penalised[1] = penalised[1] * 1.5
    assert_matches_distribution(counts, softmax(penalised))


# --- seeds ----------------------------------------------------------------------------------------------------------


def decode_seeded(seed: int, position: int, neighbours: list[SamplingParams], params: SamplingParams) -> list[int]:
    """Sample 15 steps for a seeded row placed at `position` among `neighbours`, with fixed per-step logits for
    it (the neighbours' logits differ per layout) and its own growing output as history."""
    history: list[int] = []
    row = SamplingRow(
        dataclasses.replace(params, seed=seed), torch.Generator().manual_seed(seed), [7, 8, 9], history, (0,)
    )
    others = [make_row(p) for p in neighbours]
    sampler = Sampler(seed=position + 100)  # the default generator differs between layouts too
    for step in range(15):
        step_logits = random_logits(len(others) + 1, scale=1.0, seed=1000 + len(others) + step)
        step_logits[position] = random_logits(1, scale=1.0, seed=step)[0]
        rows = others[:position] + [row] + others[position:]
        history.append(sampler.sample(step_logits, rows).token_ids[position])
    return history


NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.9, top_k=5, seed=7),
    SamplingParams(temperature=1.3, top_p=0.7, min_p=0.01),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),
]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.9, min_p=0.001, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=5.0, top_p=0.98),  # nucleus wider than the candidates: the full-sort path
    ],
    ids=["plain", "filtered", "wide_top_p"],
)
def test_same_seed_same_tokens_whatever_the_batch(params: SamplingParams) -> None:
    alone = decode_seeded(42, 0, [], params)
    assert decode_seeded(42, 3, NEIGHBOURS, params) == alone
    assert decode_seeded(42, 0, NEIGHBOURS[1:4], params) == alone
    assert decode_seeded(42, 5, NEIGHBOURS, params) == alone
    assert decode_seeded(43, 0, [], params) != alone
    assert len(set(alone)) > 3  # not degenerate


def test_sampler_seed_makes_unseeded_rows_reproducible() -> None:
    logits = random_logits(8, scale=1.0)
    rows = [make_row(SamplingParams(temperature=1.0)) for _ in range(8)]
    assert Sampler(seed=5).sample(logits, rows).token_ids == Sampler(seed=5).sample(logits, rows).token_ids
    assert Sampler(seed=5).sample(logits, rows).token_ids != Sampler(seed=6).sample(logits, rows).token_ids


# --- min_tokens -----------------------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0, 0.0]] * 4)  # eos 0, stop id 1: the two favourites
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1], ignore_eos=True)
    rows = [
        make_row(params, output=[], eos=(0,)),
        make_row(params, output=[2, 2], eos=(0,)),
        make_row(params, output=[2, 2, 2], eos=(0,)),  # reached: nothing masked
        make_row(SamplingParams(temperature=0.0, min_tokens=3), output=[], eos=(0, 1)),  # two EOS ids
    ]
    assert Sampler().sample(logits, rows).token_ids == [2, 2, 0, 2]


def test_min_tokens_masks_random_sampling_too() -> None:
    logits_row = torch.tensor([3.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # eos 0 has probability 0.75
    params = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[5, 999])  # 999: beyond the vocab
    logits = logits_row.expand(1000, 6)
    rows = [make_row(params, eos=(0,)) for _ in range(1000)]
    counts = np.bincount(Sampler(seed=0).sample(logits, rows).token_ids, minlength=6)
    assert counts[0] == 0 and counts[5] == 0 and counts[1:5].min() > 150


# --- logprobs -------------------------------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits_with_top_n_and_rank() -> None:
    logits = random_logits(4, scale=2.0)
    raw = torch.log_softmax(logits.double(), dim=-1)
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=5)),
        # penalties and temperature shape the draw, not the reported logprobs
        make_row(SamplingParams(temperature=5.0, repetition_penalty=1.5, logprobs=3, seed=1), prompt=[1, 2, 3]),
        make_row(SamplingParams(temperature=1.0)),  # asked for none
        make_row(SamplingParams(temperature=5.0, logprobs=0, seed=2)),
    ]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[2] is None
    for row_id in (0, 1, 3):
        entry = out.logprobs[row_id]
        assert entry is not None
        token = out.token_ids[row_id]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(raw[row_id, token]), abs=1e-5)
        assert entry.rank == int((logits[row_id] >= logits[row_id, token]).sum())
        num = rows[row_id].params.logprobs
        assert [t for t, _ in entry.top] == torch.topk(logits[row_id], num).indices.tolist() if num else entry.top == []
        for token_id, logprob in entry.top:
            assert logprob == pytest.approx(float(raw[row_id, token_id]), abs=1e-5)
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    assert out.logprobs[0] is not None and out.logprobs[0].rank == 1
    assert out.logprobs[0].top[0] == (out.token_ids[0], out.logprobs[0].logprob)
    # At temperature 5 the draws from a flat distribution are rarely the argmax; the rank reflects that.
    assert max(out.logprobs[1].rank, out.logprobs[3].rank) > 1  # type: ignore[union-attr]


# --- mixed batches --------------------------------------------------------------------------------------------------


def test_mixed_batch_gives_each_row_its_own_result() -> None:
    logits = random_logits(6, scale=2.0, seed=9)
    seeded = SamplingParams(temperature=0.8, top_k=10, seed=11)
    rows = [
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=1.0, top_k=3)),
        make_row(seeded),
        make_row(SamplingParams(temperature=0.0, presence_penalty=2.0), output=[int(logits[3].argmax())]),
        make_row(SamplingParams(temperature=1.0, top_p=0.3, logprobs=2)),
        make_row(SamplingParams(temperature=0.0, min_tokens=1), eos=(int(logits[5].argmax()),)),
    ]
    before = logits.clone()
    out = Sampler(seed=0).sample(logits, rows)
    assert torch.equal(logits, before)  # penalties and filters worked on copies
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] in torch.topk(logits[1], 3).indices.tolist()
    alone = Sampler(seed=123).sample(logits[2:3], [make_row(seeded)]).token_ids[0]
    assert out.token_ids[2] == alone
    assert out.token_ids[3] == int(torch.topk(logits[3], 2).indices[1])  # the favourite was penalised by 2.0
    assert out.token_ids[4] in allowed_set(logits[4].numpy(), rows[4].params)
    assert out.token_ids[5] == int(torch.topk(logits[5], 2).indices[1])
    assert [lp is not None for lp in out.logprobs] == [False, False, False, False, True, False]


def test_bfloat16_logits_are_processed_in_float32() -> None:
    logits = random_logits(4, seed=12).to(torch.bfloat16)
    rows = [
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.3), prompt=[int(logits[1].float().argmax())]),
        make_row(SamplingParams(temperature=0.8, top_k=5, logprobs=2)),
        make_row(SamplingParams(temperature=0.8, top_p=0.5, seed=3)),
    ]
    out = Sampler(seed=0).sample(logits, rows)
    assert out.token_ids[0] == int(logits[0].float().argmax())
    assert out.token_ids[1] != int(logits[1].float().argmax())
    assert out.token_ids[2] in torch.topk(logits[2].float(), 5).indices.tolist()
    assert out.logprobs[2] is not None and len(out.logprobs[2].top) == 2


def test_empty_batch_and_shape_mismatch() -> None:
    assert Sampler().sample(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler().sample(torch.zeros(3, 10), [make_row(), make_row()])


def test_row_type_is_the_public_dataclass() -> None:
    row = SamplingRow(SamplingParams(), None, [1], [], (0,))
    assert Sampler(seed=0).sample(torch.zeros(1, 4), [row]).token_ids[0] in range(4)
