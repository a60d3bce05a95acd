"""SamplingParams and TokenLogprobs on the wire: every field of the table travels, both ways, as its proto field's
declaration says; and the values a proto field cannot carry are refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from engine.request.grammar_spec import GrammarSpec
from engine.request.logprobs import TokenLogprobs
from engine.request.sampling_params import SamplingParams
from engine.request.wire import (
    check_fits_wire,
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from protos import serving_pb2

# Every field away from its default, with values a float32 holds exactly.
EVERY_FIELD = SamplingParams(
    n=3, best_of=5, temperature=0.5, top_p=0.75, top_k=7, min_p=0.25, repetition_penalty=1.5, presence_penalty=-1.0,
    frequency_penalty=1.0, seed=11, max_tokens=9, min_tokens=2, stop=["a", "b"], stop_token_ids=[3, 4],
    ignore_eos=True, include_stop_str_in_output=True, logprobs=3, skip_special_tokens=False, logit_bias={5: -2.5},
    prompt_logprobs=2, structured_outputs=GrammarSpec(kind="regex", source="a+"), priority=-3,
    allowed_token_ids=[5, 6], bad_words=["never", "this phrase"],
)


def test_the_table_and_the_proto_name_the_same_fields() -> None:
    table = {field.name for field in dataclasses.fields(SamplingParams)}
    assert table == set(serving_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def test_every_field_travels_both_ways() -> None:
    assert all(getattr(EVERY_FIELD, f.name) != getattr(SamplingParams(), f.name)
               for f in dataclasses.fields(SamplingParams))
    msg = sampling_params_to_proto(EVERY_FIELD)
    assert sampling_params_from_proto(serving_pb2.SamplingParams.FromString(msg.SerializeToString())) == EVERY_FIELD
    assert msg.structured_outputs.kind == "regex" and dict(msg.logit_bias) == {5: -2.5} and msg.n == 3


def test_defaults_on_the_wire() -> None:
    """Optional fields set unless None; plain ones left at their default; unset reads back as vLLM's defaults,
    except max_tokens, whose unset means no cap but the context (as a GenerateRequest may leave it)."""
    msg = sampling_params_to_proto(SamplingParams())
    assert msg == serving_pb2.SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=16,
                                             skip_special_tokens=True)
    assert sampling_params_from_proto(msg) == SamplingParams()
    assert sampling_params_from_proto(serving_pb2.SamplingParams()) == SamplingParams(max_tokens=None)
    zero = serving_pb2.SamplingParams(temperature=0.0, logprobs=0, prompt_logprobs=0)  # 0, set: kept
    assert sampling_params_from_proto(zero) == SamplingParams(temperature=0.0, logprobs=0, prompt_logprobs=0,
                                                              max_tokens=None)
    assert sampling_params_from_proto(serving_pb2.SamplingParams(n=0)).n == 1  # unset


def test_seeds_travel_as_int64() -> None:
    for seed, on_wire in [(2**64 - 1, -1), (2**63, -(2**63)), (-5, -5), (0, 0)]:
        msg = sampling_params_to_proto(SamplingParams(seed=seed))
        assert msg.HasField("seed") and msg.seed == on_wire
        assert sampling_params_from_proto(msg).seed == on_wire  # seeds a torch.Generator as `seed` does


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"temperature": 1e39}, "temperature"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
     ({"top_k": 2**31}, "top_k"), ({"stop_token_ids": [1, 2**32]}, "stop_token_ids"),
     ({"logit_bias": {2**32: 1.0}}, "logit_bias keys"), ({"max_tokens": -1}, "max_tokens"),
     ({"priority": -(2**31) - 1}, "priority")],
)
def test_values_the_wire_cannot_carry_are_refused_by_name(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named} must be"):
        check_fits_wire(SamplingParams(**fields))


def test_values_the_wire_carries_pass() -> None:
    check_fits_wire(EVERY_FIELD)
    check_fits_wire(SamplingParams(temperature=3.4e38, top_k=2**31 - 1, stop_token_ids=[2**32 - 1], seed=2**64 - 1,
                                   max_tokens=None, priority=2**31 - 1))
    check_fits_wire(SamplingParams(priority=-(2**31)))


def test_logprobs_travel_both_ways() -> None:
    lp = TokenLogprobs(token_id=7, logprob=-0.5, rank=2, top=[(3, -0.25), (7, -0.5)])
    assert logprobs_from_proto(serving_pb2.TokenLogprobs.FromString(logprobs_to_proto(lp).SerializeToString())) == lp
