"""SamplingParams: vLLM's defaults and normalizations, and validation that names the bad parameter."""

from __future__ import annotations

import math

import pytest

from engine.request.grammar_spec import GrammarSpec
from engine.request.sampling_params import SamplingParams


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    params.validate()
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.repetition_penalty == 1.0
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.ignore_eos is False
    assert params.logprobs is None
    assert params.greedy is False


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        SamplingParams(1)  # type: ignore[misc]


def test_normalizations() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(temperature=0.0).greedy is True
    assert SamplingParams(temperature=1e-5).greedy is False


def test_default_lists_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    a.stop_token_ids.append(1)
    assert b.stop == [] and b.stop_token_ids == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=2.5),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(repetition_penalty=0.01),
        dict(presence_penalty=-2.0),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=-2.0),
        dict(frequency_penalty=2.0),
        dict(max_tokens=1),
        dict(max_tokens=None, min_tokens=10_000),
        dict(max_tokens=5, min_tokens=5),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(logprobs=10_000),  # the cap is the engine's (check_engine_rules)
        dict(stop=["a", "\n"]),
        dict(stop_token_ids=[0, 2]),
        dict(priority=-(2**31)),
        dict(priority=2**31 - 1),
    ],
    ids=repr,
)
def test_boundary_values_are_valid(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(n=129), "n"),
        (dict(n=0), "n"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.01), "min_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(presence_penalty=-2.01), "presence_penalty"),
        (dict(presence_penalty=2.01), "presence_penalty"),
        (dict(presence_penalty=math.nan), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=2.01), "frequency_penalty"),
        (dict(frequency_penalty=math.nan), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(bad_words=["ok", " "]), "bad_words"),
        (dict(bad_words=["x"], structured_outputs=GrammarSpec(kind="regex", source="a+")), "bad_words"),
        (dict(stop=[""]), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=""), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[3, -5]), "stop_token_ids"),
        (dict(priority=2**31), "priority"),
        (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
        (dict(allowed_token_ids=[3], structured_outputs=GrammarSpec(kind="regex", source="a+")), "allowed_token_ids"),
    ],
    ids=lambda v: v if isinstance(v, str) else repr(v),
)
def test_bad_value_raises_naming_the_parameter(kwargs: dict, name: str) -> None:
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as excinfo:
        params.validate()
    message = str(excinfo.value)
    assert message.split()[0] == name, message


def test_the_engines_rules_cap_logprobs_and_take_priority_only_under_its_policy() -> None:
    from engine.request.sampling_params import check_engine_rules

    rules = {"scheduling_policy": "fcfs", "max_logprobs": 20}
    check_engine_rules(SamplingParams(logprobs=20, prompt_logprobs=20), **rules)
    for params, name in ((SamplingParams(logprobs=21), "logprobs"), (SamplingParams(prompt_logprobs=21),
                                                                      "prompt_logprobs")):
        with pytest.raises(ValueError, match=rf"^{name} must be in \[0, 20\] \(the engine's --max-logprobs\)"):
            check_engine_rules(params, **rules)
    check_engine_rules(SamplingParams(logprobs=5000), scheduling_policy="fcfs", max_logprobs=-1)  # the engine's vocab
    with pytest.raises(ValueError, match="logprobs must be in \\[0, 0\\]"):
        check_engine_rules(SamplingParams(logprobs=1), scheduling_policy="fcfs", max_logprobs=0)
    with pytest.raises(ValueError, match="^priority 2 needs --scheduling-policy priority"):
        check_engine_rules(SamplingParams(priority=2), **rules)
    check_engine_rules(SamplingParams(priority=2), scheduling_policy="priority", max_logprobs=20)
