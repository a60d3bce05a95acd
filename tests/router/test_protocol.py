"""Request conversion and validation, prompt fitting, and the response shapes, without any server."""

from __future__ import annotations

import pytest

from engine.request.sampling_params import SamplingParams
from protos import serving_pb2
from router.errors import ApiError, error_body
from router.prompt import chat_prompt_token_ids, completion_prompt_token_ids, fit_max_tokens
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_chat_request,
    check_completion_request,
    to_sampling_params,
)
from router.responses import (
    ResponseHeader,
    Usage,
    chat_logprobs,
    chunk_body,
    completion_logprobs,
    openai_stop_reason,
    response_body,
    sse_event,
    usage_chunk_body,
)
from tests.router.fake_worker import byte_tokenizer, token_ids_of

TOKENIZER = byte_tokenizer()


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_defaults_convert_to_vllm_defaults() -> None:
    assert to_sampling_params(completion(), max_tokens=16) == SamplingParams(max_tokens=16)
    assert to_sampling_params(chat(), max_tokens=7) == SamplingParams(max_tokens=7)


def test_every_field_converts() -> None:
    request = completion(temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=7, stop="x", stop_token_ids=[3],
                         ignore_eos=True, min_tokens=1, include_stop_str_in_output=True, skip_special_tokens=False,
                         presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.2, logprobs=0)
    assert to_sampling_params(request, max_tokens=4) == SamplingParams(
        temperature=0.0, top_p=0.5, top_k=0, min_p=0.1, seed=7, stop=["x"], stop_token_ids=[3], ignore_eos=True,
        min_tokens=1, include_stop_str_in_output=True, skip_special_tokens=False, presence_penalty=1.0,
        frequency_penalty=-1.0, repetition_penalty=1.2, logprobs=0, max_tokens=4)
    derived = completion(n=2, best_of=3, logit_bias={"5": -1.5}, echo=True, logprobs=1, prompt_logprobs=0)
    assert to_sampling_params(derived, max_tokens=4) == SamplingParams(
        n=2, best_of=3, logit_bias={5: -1.5}, logprobs=1, prompt_logprobs=1, max_tokens=4)
    assert to_sampling_params(completion(n=2, best_of=3), max_tokens=4).logprobs == 0  # best_of ranks by them


def test_chat_logprobs_convert() -> None:
    assert to_sampling_params(chat(), max_tokens=1).logprobs is None
    assert to_sampling_params(chat(logprobs=True), max_tokens=1).logprobs == 0
    assert to_sampling_params(chat(logprobs=True, top_logprobs=5), max_tokens=1).logprobs == 5


def test_seeds_in_torchs_range_pass() -> None:
    assert to_sampling_params(completion(seed=2**64 - 1), max_tokens=1).seed == 2**64 - 1  # int64 on the wire
    assert to_sampling_params(completion(seed=-5), max_tokens=1).seed == -5


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
     ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"presence_penalty": -3}, "presence_penalty"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
     ({"min_tokens": 20}, "min_tokens"), ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"),
     ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2**32]}, "stop_token_ids"),
     ({"seed": -(2**63) - 1}, "seed"), ({"temperature": float("nan")}, "temperature"),
     ({"temperature": 1e39}, "temperature"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
     ({"top_k": 2**31}, "top_k"), ({"logit_bias": {"1": 101}}, "logit_bias"), ({"priority": 2**31}, "priority"),
     ({"priority": 1}, "priority")],  # fcfs (the default policy) takes only priority 0
)
def test_validation_names_the_parameter(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as error:
        to_sampling_params(completion(**fields), max_tokens=16)
    assert error.value.status_code == 400 and error.value.param == param


def test_a_priority_goes_to_the_workers_under_the_priority_policy() -> None:
    assert to_sampling_params(chat(priority=-4), max_tokens=1, scheduling_policy="priority").priority == -4
    assert to_sampling_params(completion(priority=0), max_tokens=1).priority == 0
    with pytest.raises(ApiError, match="priority 3 needs --scheduling-policy priority") as error:
        to_sampling_params(chat(priority=3), max_tokens=1, scheduling_policy="fcfs")
    assert error.value.param == "priority"


def test_the_workers_max_logprobs_caps_logprobs_at_the_gateway() -> None:
    assert to_sampling_params(completion(logprobs=30), max_tokens=1, max_logprobs=30).logprobs == 30
    assert to_sampling_params(chat(logprobs=True, top_logprobs=500), max_tokens=1, max_logprobs=-1).logprobs == 500
    with pytest.raises(ApiError, match="must be in \\[0, 4\\]") as error:
        to_sampling_params(chat(logprobs=True, top_logprobs=5), max_tokens=1, max_logprobs=4)
    assert error.value.param == "top_logprobs"
    with pytest.raises(ApiError) as error:
        to_sampling_params(completion(echo=True, logprobs=1, prompt_logprobs=5), max_tokens=1, max_logprobs=4)
    assert error.value.param == "prompt_logprobs"


def test_chat_validation_names_chat_parameters() -> None:
    with pytest.raises(ApiError) as error:
        to_sampling_params(chat(logprobs=True, top_logprobs=21), max_tokens=1)
    assert error.value.param == "top_logprobs"
    with pytest.raises(ApiError) as error:
        to_sampling_params(chat(max_completion_tokens=0), max_tokens=0)
    assert error.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("check", "request_", "param"),
    [(check_completion_request, completion(best_of=3, stream=True), "best_of"),
     (check_completion_request, completion(suffix="s"), "suffix"),
     (check_completion_request, completion(logit_bias={"one": 2.0}), "logit_bias"),
     (check_chat_request, chat(logit_bias={"-1": 2.0}), "logit_bias"),
     (check_chat_request, chat(top_logprobs=1), "top_logprobs")],
)
def test_unsupported_fields(check, request_, param: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError) as error:
        check(request_)
    assert error.value.param == param


def test_supported_fields_pass() -> None:
    check_completion_request(completion(best_of=1, logit_bias={}, user="u"))
    check_completion_request(completion(n=2, best_of=3, echo=True, logit_bias={"1": 2.0}))
    check_chat_request(chat(response_format={"type": "text"}, tools=[], unknown_field=1))


def test_completion_prompts() -> None:
    assert completion_prompt_token_ids(completion(prompt="ab"), TOKENIZER) == token_ids_of("ab")
    assert completion_prompt_token_ids(completion(prompt=["ab"]), TOKENIZER) == token_ids_of("ab")
    assert completion_prompt_token_ids(completion(prompt=[4, 5]), TOKENIZER) == [4, 5]
    assert completion_prompt_token_ids(completion(prompt=[[4, 5]]), TOKENIZER) == [4, 5]
    for bad in ("", [], [[]], [259], [-1]):  # a batch of two or more is split first (test_batched_completions.py)
        with pytest.raises(ApiError) as error:
            completion_prompt_token_ids(completion(prompt=bad), TOKENIZER)
        assert error.value.param == "prompt", bad


def test_chat_prompts() -> None:
    request = chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": None}])
    text = "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    ids = chat_prompt_token_ids(request, TOKENIZER)
    assert ids == TOKENIZER.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[0] == 1  # <|im_start|> is one special token, not its characters
    no_prompt = chat_prompt_token_ids(chat(add_generation_prompt=False), TOKENIZER)
    assert TOKENIZER.decode(no_prompt, skip_special_tokens=False).endswith("hi<|im_end|>\n")


def test_chat_template_kwargs_reach_the_template() -> None:
    """vLLM's `chat_template_kwargs`: more variables the template sees (e.g. `enable_thinking`); the request's own
    fields (messages, add_generation_prompt, ...) cannot be set through them; their text is held to the rules of
    the messages' (it becomes prompt text)."""
    tokenizer = TOKENIZER.with_chat_template(
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}{{ messages[0].content }}"
        "{{ suffix | default('') }}")
    assert chat_prompt_token_ids(chat(), tokenizer) == tokenizer.encode("hi", add_special_tokens=False)
    request = chat(chat_template_kwargs={"enable_thinking": False, "suffix": "!"})
    check_chat_request(request)
    assert chat_prompt_token_ids(request, tokenizer) == tokenizer.encode("/no_think hi!", add_special_tokens=False)
    with pytest.raises(ApiError) as error:
        chat_prompt_token_ids(chat(chat_template_kwargs={"messages": [], "add_generation_prompt": 1}), tokenizer)
    assert error.value.param == "chat_template_kwargs"
    assert "may not set add_generation_prompt, messages" in error.value.message
    for bad, where in (({"a": {"b": ["ok", "\ud800"]}}, "chat_template_kwargs.a.b[1]"),
                       ({"\x00": 1}, "a key of chat_template_kwargs")):
        with pytest.raises(ApiError) as error:
            check_chat_request(chat(chat_template_kwargs=bad))
        assert error.value.param == "chat_template_kwargs" and error.value.message.startswith(where), bad


def test_fit_max_tokens() -> None:
    fit = {"num_prompt_tokens": 10, "max_model_len": 32, "prompt_param": "prompt", "max_tokens_param": "max_tokens"}
    assert fit_max_tokens(None, default=16, **fit) == 16
    assert fit_max_tokens(None, default=None, **fit) == 22
    assert fit_max_tokens(None, default=30, **fit) == 22  # a default is clipped to the room left
    assert fit_max_tokens(22, default=16, **fit) == 22
    assert fit_max_tokens(0, default=16, **fit) == 0  # SamplingParams.validate() rejects it with its own message
    with pytest.raises(ApiError, match="you requested 33 tokens") as error:
        fit_max_tokens(23, default=16, **fit)
    assert error.value.param == "max_tokens"
    with pytest.raises(ApiError, match="your prompt has 32 tokens") as error:
        fit_max_tokens(None, default=16, **{**fit, "num_prompt_tokens": 32})
    assert error.value.param == "prompt"


def test_stop_reason() -> None:
    def finished(finish_reason: str, **reason: object) -> serving_pb2.GenerateResponse:
        return serving_pb2.GenerateResponse(finish_reason=finish_reason, stop_reason=serving_pb2.StopReason(**reason))

    assert openai_stop_reason(finished("stop", stop_string="7")) == "7"
    assert openai_stop_reason(finished("stop", stop_token_id=7)) == 7
    assert openai_stop_reason(finished("stop", stop_string="")) == ""  # set, though no request sends an empty stop
    assert openai_stop_reason(finished("stop")) is None  # EOS
    assert openai_stop_reason(serving_pb2.GenerateResponse(finish_reason="stop")) is None
    assert openai_stop_reason(finished("length", stop_string="x")) is None


def entry(token: str, logprob: float, *top: tuple[str, float]) -> serving_pb2.TokenLogprobs:
    (token_id,) = token_ids_of(token)
    return serving_pb2.TokenLogprobs(token_id=token_id, logprob=logprob, top=[
        serving_pb2.TopLogprob(token_id=token_ids_of(t)[0], logprob=lp) for t, lp in top])


def test_completion_logprobs_shape() -> None:
    body, offset = completion_logprobs([entry("a", -0.5, ("b", -0.25)), entry("c", -1.0)], TOKENIZER, text_offset=3)
    assert body == {"tokens": ["a", "c"], "token_logprobs": [-0.5, -1.0],
                    "top_logprobs": [{"b": -0.25, "a": -0.5}, {"c": -1.0}], "text_offset": [3, 4]}
    assert offset == 5
    eos = serving_pb2.TokenLogprobs(token_id=2, logprob=float("-inf"))
    body, _ = completion_logprobs([eos], TOKENIZER)
    assert body["tokens"] == ["<|im_end|>"] and body["token_logprobs"] == [-9999.0]  # special tokens spelled out


def test_chat_logprobs_shape() -> None:
    # "é" is two byte tokens: each token's text is a replacement character, its bytes are exact.
    first, second = token_ids_of("é")
    entries = [serving_pb2.TokenLogprobs(token_id=first, logprob=-0.5,
                                         top=[serving_pb2.TopLogprob(token_id=second, logprob=-2.0)])]
    assert chat_logprobs(entries, TOKENIZER) == {"content": [
        {"token": "\ufffd", "logprob": -0.5, "bytes": [0xC3],
         "top_logprobs": [{"token": "\ufffd", "logprob": -2.0, "bytes": [0xA9]}]}], "refusal": None}


def test_bodies_and_chunks() -> None:
    header = ResponseHeader(request_id="chatcmpl-1", created=5, model="m", chat=True)
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    body = response_body(header, text="hi", finish_reason="stop", stop_reason=None, logprobs=None, usage=usage)
    assert body == {"id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                 "finish_reason": "stop", "stop_reason": None}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}}
    assert chunk_body(header, text=None, role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk_body(header, text="x", include_usage=True)["usage"] is None
    assert usage_chunk_body(header, usage)["choices"] == []
    plain = ResponseHeader(request_id="cmpl-1", created=5, model="m", chat=False)
    chunk = chunk_body(plain, text="x", finish_reason="length")
    assert chunk["object"] == "text_completion" and "usage" not in chunk
    assert chunk["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length",
                                 "stop_reason": None}]
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'


def test_error_body() -> None:
    assert error_body(400, "bad", "top_p") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "top_p", "code": 400}}
    assert error_body(503, "busy")["error"]["type"] == "ServiceUnavailableError"


def test_best_of_returns_the_n_choices_of_highest_cumulative_logprob() -> None:
    from router.streaming import _Choice, best_choices

    def choice(*logprobs: float) -> _Choice:
        return _Choice(texts=[str(logprobs)], entries=[serving_pb2.TokenLogprobs(logprob=lp) for lp in logprobs])

    choices = {0: choice(-1.0, -1.0), 1: choice(-0.5), 2: choice(-0.1, -0.2), 3: choice(-3.0)}
    assert best_choices(choices, 2) == [choices[2], choices[1]]  # best first
    assert best_choices(choices, 4) == [choices[0], choices[1], choices[2], choices[3]]  # n of n: index order
