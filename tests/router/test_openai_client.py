"""The official `openai` client, unmodified, against the router served by uvicorn (fake workers behind it)."""

from __future__ import annotations

import openai
import pytest

from tests.router.conftest import MODEL, Cluster
from tests.router.fake_worker import Script


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=30.0)


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5, logprobs=1)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    choice = completion.choices[0]
    assert choice.text == "Hello" and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.tokens == list("Hello")
    assert completion.usage is not None and completion.usage.completion_tokens == 5


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Say hi", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "Hello world"
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 6 + 11


def test_chat(client: openai.OpenAI, cluster: Cluster) -> None:
    cluster.decode.script = Script(text="Hi there!", finish_reason="stop", stop_reason="!")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_completion_tokens=20, temperature=0.0, stop=["!"], logprobs=True,
                                          top_logprobs=1)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == "Hi there!"
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content[0].token == "H"
    assert cluster.decode.requests[0].params.temperature == 0.0


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=5, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Hello"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_raise_the_clients_exceptions(client: openai.OpenAI, cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError):  # 404, as vLLM and OpenAI answer an unknown model
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    cluster.decode.script = Script(error_after=2)
    with pytest.raises(openai.APIError):  # an error event mid-stream
        list(client.completions.create(model=MODEL, prompt="x", stream=True))


def test_n_choices_echo_and_logit_bias(client: openai.OpenAI, cluster: Cluster) -> None:
    completion = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5, n=3, seed=1,
                                           logit_bias={"72": -100, "101": 2.5})
    assert [(c.index, c.text) for c in completion.choices] == [(0, "Hello"), (1, "Hello"), (2, "Hello")]
    assert completion.usage is not None and (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        6, 15)  # the prompt once, every choice's tokens
    params = cluster.decode.requests[-1].params
    assert params.n == 3 and dict(params.logit_bias) == {72: -100.0, 101: 2.5}

    echoed = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=2, echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == "Say hiHe" and cluster.decode.requests[-1].params.prompt_logprobs == 1
    assert choice.logprobs is not None and choice.logprobs.tokens == [*"Say hi", "H", "e"]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == [-0.25] * 7
    assert choice.logprobs.text_offset == list(range(8))

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=3, n=2, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: "Hel", 1: "Hel"}
    assert sorted(c.index for chunk in chunks for c in chunk.choices if c.finish_reason) == [0, 1]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI, cluster: Cluster) -> None:
    """vLLM's field (the client passes it in `extra_body`): the workers get the last k tokens, usage and echo are
    of those; -1 keeps max_model_len of them; a value out of range is a 400 naming the field."""
    from tests.router.conftest import MAX_MODEL_LEN
    from tests.router.fake_worker import token_ids_of

    echoed = client.completions.create(model=MODEL, prompt="Say hello there", max_tokens=2, echo=True, logprobs=1,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert list(cluster.decode.requests[-1].prompt_token_ids) == token_ids_of("there")
    assert echoed.usage is not None and echoed.usage.prompt_tokens == 5
    choice = echoed.choices[0]
    assert choice.text == "thereHe" and choice.logprobs is not None and choice.logprobs.tokens[:5] == list("there")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 40}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage is not None and chat.usage.prompt_tokens == 7
    assert len(cluster.decode.requests[-1].prompt_token_ids) == 7
    kept = client.completions.create(model=MODEL, prompt="y" * (MAX_MODEL_LEN + 20), max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN - 1})
    assert kept.usage is not None and kept.usage.prompt_tokens == MAX_MODEL_LEN - 1
    short = client.completions.create(model=MODEL, prompt="abc", max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert short.usage is not None and short.usage.prompt_tokens == 3  # nothing to cut
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="abc", max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": bad})
        assert refused.value.body["param"] == "truncate_prompt_tokens", bad


def test_continue_final_message_sends_the_prompt_open_inside_the_last_message(client: openai.OpenAI,
                                                                               cluster: Cluster) -> None:
    """vLLM's field (with add_generation_prompt false): the prompt ends with the assistant's partial text; both
    true is a 400 naming the field."""
    from tests.router.fake_worker import token_ids_of

    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                   extra_body={"continue_final_message": True, "add_generation_prompt": False})
    prompt = list(cluster.decode.requests[-1].prompt_token_ids)
    assert prompt[-len(token_ids_of("The colour is")):] == token_ids_of("The colour is")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert refused.value.body["param"] == "continue_final_message"
