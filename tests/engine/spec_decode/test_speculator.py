"""The speculator between policy, cost model and proposer, on control-plane requests (no model, no torch)."""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.request.sampling_params import SamplingParams
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.speculator import Speculator

REPEATING = [5, 6, 7, 8] * 6  # prompt lookup always has a guess


def _decoding(request_id: str) -> Request:
    request = Request(request_id, REPEATING, SamplingParams(max_tokens=100), eos_token_ids=(0,), max_tokens=100,
                      hash_namespace=None)
    request.append_output_token(5)
    request.num_computed_tokens = request.num_tokens - 1
    request.status = RequestStatus.RUNNING
    return request


def _speculator(policy: str = "dynamic") -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, policy=policy, prompt_lookup_min=1)
    speculator = Speculator(config, NgramProposer(min_n=1, max_n=3), token_budget=2048)
    for num_tokens in range(1, 200, 7):  # a measured machine: 10 ms a step plus 0.5 ms a token
        speculator.cost_model.observe_step(num_tokens, 0.010 + 0.0005 * num_tokens)
    return speculator


def _mean_k(speculator: Speculator, num_requests: int) -> float:
    running = [_decoding(f"r{i}") for i in range(num_requests)]
    speculator.engine_acceptance.acceptance_rate = 0.8  # what new requests start from
    speculator.propose(running, [])
    return sum(len(r.spec_token_ids) for r in running) / num_requests


def test_dynamic_k_falls_under_load_and_comes_back() -> None:
    speculator = _speculator()
    light, heavy, light_again = _mean_k(speculator, 2), _mean_k(speculator, 150), _mean_k(speculator, 2)
    assert light == light_again == 4
    assert heavy == 0
    assert speculator.chosen_k[4] == 4 and speculator.chosen_k[0] == 150


def test_nothing_measured_yet_means_no_drafts_until_a_step_is_timed() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    speculator = Speculator(config, NgramProposer(min_n=1, max_n=3), token_budget=2048)
    assert _mean_k(speculator, 1) == 0
    speculator.cost_model.observe_step(10, 0.02)
    assert _mean_k(speculator, 1) > 0


def test_fixed_policy_ignores_load() -> None:
    assert _mean_k(_speculator("fixed"), 150) == 4


def test_a_request_that_rejects_everything_stops_drafting_under_load() -> None:
    speculator = _speculator()
    good, bad = _decoding("good"), _decoding("bad")
    others = [_decoding(f"o{i}") for i in range(40)]
    for _ in range(10):
        good.spec.record(4, 4)  # every draft accepted
    assert good.spec.acceptance_rate > 0.95
    for _ in range(10):
        bad.spec.record(4, 0)  # every first draft rejected
    assert bad.spec.acceptance_rate < 0.1
    speculator.propose([good, bad, *others], [])
    assert len(good.spec_token_ids) > 0 and bad.spec_token_ids == []


def test_a_new_request_starts_from_what_the_proposer_achieved_not_a_fixed_prior() -> None:
    speculator = _speculator()
    first = _decoding("first")
    speculator.propose([first], [])
    assert first.spec.acceptance_rate == 0.5  # nothing verified yet anywhere: the neutral prior
    for _ in range(60):  # the proposer's drafts are all rejected, whoever drafts them
        speculator.engine_acceptance.record(4, 0, smoothing=0.05)
    newcomer, veteran = _decoding("newcomer"), _decoding("veteran")
    veteran.spec.record(4, 4)
    rate = veteran.spec.acceptance_rate
    speculator.propose([newcomer, veteran], [])
    assert newcomer.spec.acceptance_rate < 0.05  # starts where the engine's estimate stands
    assert veteran.spec.acceptance_rate == rate  # its own verifications are its own
