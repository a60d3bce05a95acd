"""The dynamic policy on numbers, its cost model on synthetic timings, and prompt lookup on token lists."""

from __future__ import annotations

import random

import pytest

from engine.spec_decode.cost_model import StepCostModel
from engine.spec_decode.ngram_proposer import propose_ngram
from engine.spec_decode.policy import StepCosts, choose_dynamic, choose_fixed

# A 10 ms step, 0.5 ms per token, prompt lookup nearly free: a small model on a CPU.
COSTS = StepCosts(overhead_s=0.010, per_token_s=0.0005, per_draft_s=0.00002)


def _choose(rates: list[float], *, num_base_tokens: int | None = None, budget: int = 4096,
            costs: StepCosts = COSTS, max_num_drafts: int = 4, num_prompt_tokens: int = 0) -> list[int]:
    return choose_dynamic(rates, max_num_drafts=max_num_drafts, token_budget=budget, costs=costs,
                          num_base_tokens=len(rates) if num_base_tokens is None else num_base_tokens,
                          num_prompt_tokens=num_prompt_tokens)


def test_k_falls_as_the_batch_grows_and_comes_back() -> None:
    mean_k = [sum(_choose([0.7] * n)) / n for n in range(1, 80)]
    assert mean_k[0] == 4 and mean_k[-1] == 0
    assert mean_k == sorted(mean_k, reverse=True)
    assert {1.0, 2.0, 3.0} <= set(mean_k)  # it passes through every k on the way down: no jump from 4 to 0
    # Pure: the same load gives the same k, so k comes back when the batch shrinks again.
    assert [sum(_choose([0.7] * n)) / n for n in range(79, 0, -1)] == mean_k[::-1]


@pytest.mark.parametrize("seed", range(3))
def test_no_cliff_each_request_moves_by_at_most_one_per_added_request(seed: int) -> None:
    rates = random.Random(seed).choices([0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95], k=200)
    previous = _choose(rates[:1])
    for n in range(2, 200):
        ks = _choose(rates[:n])
        assert all(abs(a - b) <= 1 for a, b in zip(previous, ks)), n
        previous = ks
    assert sum(_choose(rates[:5])) > sum(previous[:5])  # the same requests draft less under load


def test_better_acceptance_gets_more_drafts() -> None:
    ks = _choose([0.95, 0.8, 0.5, 0.2, 0.0], num_base_tokens=20)
    assert ks == sorted(ks, reverse=True)
    assert ks[0] == 4 and ks[-1] == 0


def test_token_budget_caps_the_drafts() -> None:
    assert sum(_choose([0.9] * 8, num_base_tokens=8, budget=13)) == 5
    assert _choose([0.9] * 8, num_base_tokens=8, budget=8) == [0] * 8


def test_costlier_drafts_mean_fewer_drafts() -> None:
    cheap = sum(_choose([0.7] * 8))
    dear = sum(_choose([0.7] * 8, costs=StepCosts(overhead_s=0.010, per_token_s=0.0005, per_draft_s=0.0005)))
    assert cheap > dear > 0
    # A step whose fixed part dominates makes each draft cheap relative to the step: more drafts.
    assert sum(_choose([0.7] * 8, costs=StepCosts(overhead_s=0.1, per_token_s=0.0005, per_draft_s=0.0))) > cheap


def test_expected_goodput_is_maximal_over_small_batches() -> None:
    """Against brute force over every k vector, for a few small batches."""
    import itertools

    def goodput(rates: list[float], ks: tuple[int, ...], base: int) -> float:
        tokens = sum(sum(a**j for j in range(k + 1)) for a, k in zip(rates, ks))
        step_s = COSTS.overhead_s + COSTS.per_token_s * (base + sum(ks)) + COSTS.per_draft_s * sum(ks)
        return tokens / step_s

    for rates in ([0.9, 0.4], [0.6, 0.6, 0.3], [0.99, 0.1, 0.5]):
        for base in (len(rates), 40):
            best = max(goodput(rates, ks, base) for ks in itertools.product(range(5), repeat=len(rates)))
            chosen = tuple(_choose(rates, num_base_tokens=base))
            assert goodput(rates, chosen, base) == pytest.approx(best, rel=1e-12), (rates, base, chosen)


def test_fixed_policy() -> None:
    assert choose_fixed(3, 4) == [4, 4, 4]


def test_cost_model_fits_a_line_to_measured_steps() -> None:
    model = StepCostModel()
    assert model.costs() is None
    model.observe_step(10, 0.010 + 0.0005 * 10)
    only_one_size = model.costs()  # no slope yet: the time is split between the fixed part and the tokens
    assert only_one_size is not None
    assert only_one_size.overhead_s + 10 * only_one_size.per_token_s == pytest.approx(0.015)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 300)
        model.observe_step(n, (0.010 + 0.0005 * n) * rng.uniform(0.98, 1.02))
    model.observe_draft(4, 0.0004)
    model.observe_draft(0, 1.0)  # nothing drafted: ignored
    costs = model.costs()
    assert costs is not None
    assert costs.overhead_s == pytest.approx(0.010, rel=0.2)
    assert costs.per_token_s == pytest.approx(0.0005, rel=0.05)
    assert costs.per_draft_s == pytest.approx(0.0001)


def test_cost_model_follows_a_machine_that_slows_down() -> None:
    model = StepCostModel()
    for i in range(400):
        n = 1 + i % 50
        slow = 1.0 if i < 200 else 3.0
        model.observe_step(n, slow * (0.010 + 0.0005 * n))
    costs = model.costs()
    assert costs is not None and costs.per_token_s == pytest.approx(0.0015, rel=0.05)


def test_cost_model_prices_a_draft_at_the_decode_steps_marginal_cost_not_the_prompt_chunks() -> None:
    # A CPU: a prompt token in a big chunk costs 0.2 ms, a decode token 2 ms (a 64-request step is nearly
    # compute-bound). One line over every step would slope at the chunks' cost and underprice drafts.
    model = StepCostModel()
    rng = random.Random(1)
    for i in range(300):
        num_decode = rng.randint(48, 120)
        model.observe_step(num_decode, 0.005 + 0.002 * num_decode)
        if i % 5 == 0:  # a step with a 2048-token chunk beside the decodes
            model.observe_step(2048 + num_decode, 0.005 + 0.002 * num_decode + 0.0002 * 2048,
                               num_prompt_tokens=2048)
    costs = model.costs()
    assert costs is not None
    assert costs.per_token_s == pytest.approx(0.002, rel=0.02)
    assert costs.overhead_s == pytest.approx(0.005, rel=0.1)
    assert costs.per_prompt_token_s == pytest.approx(0.0002, rel=0.05)
    # the one-line fit it replaces: its slope is the chunks' price, a tenth of what a draft costs
    every = StepCostModel()
    for num_tokens in (64, 2048 + 64):
        every.observe_step(num_tokens, 0.005 + 0.002 * 64 + 0.0002 * (num_tokens - 64))
    assert every.costs().per_token_s == pytest.approx(0.0002, rel=0.05)  # type: ignore[union-attr]


def test_drafts_stop_at_a_nearly_compute_bound_decode_step() -> None:
    # 64 decoding requests accepting 0.7 of drafts: a draft costs as much as a decode token and the step has
    # hardly any fixed part, so no draft pays; the old one-line fit (chunk-priced tokens) handed out dozens.
    honest = StepCosts(overhead_s=0.005, per_token_s=0.002, per_draft_s=0.0)
    underpriced = StepCosts(overhead_s=0.005 + 64 * 0.0018, per_token_s=0.0002, per_draft_s=0.0)
    assert sum(_choose([0.7] * 64, costs=honest)) == 0
    assert sum(_choose([0.7] * 64, costs=underpriced)) > 32


def test_prompt_tokens_in_the_step_are_priced_at_their_own_cost() -> None:
    # A step with a 2000-token chunk is long whatever the drafts do: a draft's share of it is small, so the
    # decoding requests draft; priced as 2000 decode tokens the step would look longer still.
    costs = StepCosts(overhead_s=0.005, per_token_s=0.002, per_draft_s=0.0, per_prompt_token_s=0.0002)
    alone = _choose([0.6] * 8, costs=costs)
    beside_a_chunk = _choose([0.6] * 8, costs=costs, num_base_tokens=8 + 2000, num_prompt_tokens=2000)
    assert sum(beside_a_chunk) > sum(alone)
    as_decode = StepCosts(overhead_s=0.005, per_token_s=0.002, per_draft_s=0.0)
    assert sum(_choose([0.6] * 8, costs=as_decode, num_base_tokens=2008, num_prompt_tokens=2000)) >= sum(
        beside_a_chunk)


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # "1 2 3" recurs: what followed it
        ([1, 2, 3, 9, 1, 2, 3], 10, [9, 1, 2, 3]),  # never past the end
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1]),  # the latest earlier match wins
        ([1, 2, 3, 4, 5], 3, []),  # nothing recurs
        ([7, 7], 2, [7]),  # a one-token suffix (min 1)
        ([1, 2, 3, 1, 2], 0, []),
    ],
)
def test_prompt_lookup(tokens: list[int], k: int, expected: list[int]) -> None:
    assert propose_ngram(tokens, k, min_n=1, max_n=3) == expected


def test_prompt_lookup_prefers_the_longest_suffix() -> None:
    tokens = [4, 2, 3, 50, 1, 2, 3, 60, 9, 1, 2, 3]  # "2 3" last followed 60... "1 2 3" last followed by 60 too
    assert propose_ngram(tokens, 1, min_n=2, max_n=3) == [60]
    tokens = [1, 2, 3, 50, 9, 2, 3, 60, 1, 2, 3]  # "1 2 3" -> 50; the shorter "2 3" would say 60
    assert propose_ngram(tokens, 1, min_n=2, max_n=3) == [50]
    assert propose_ngram(tokens, 1, min_n=2, max_n=2) == [60]
