"""POST /tokenize and /detokenize (vLLM's), answered by the gateway from its tokenizer: a prompt's count and ids, a
chat's exactly as /v1/chat/completions would send it, ids back to text; bad input a 400 in OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from router.prompt import chat_prompt_token_ids
from router.protocol import ChatCompletionRequest
from tests.router.conftest import MAX_MODEL_LEN, MODEL, Cluster

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"}]


def test_a_prompts_count_and_ids(cluster: Cluster) -> None:
    tokenizer = cluster.tokenizer
    response = cluster.client.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"})
    assert response.status_code == 200, response.text
    expected = tokenizer.encode("Hello there")
    assert response.json() == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected,
                               "token_strs": None}
    bare = cluster.client.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False,
                                                  "return_token_strs": True}).json()  # no model: the served one
    assert bare["tokens"] == tokenizer.encode("Hello there", add_special_tokens=False)
    assert bare["token_strs"] == [tokenizer.id_to_token(i) for i in bare["tokens"]]


def test_a_chat_counts_what_the_chat_endpoint_would_send(cluster: Cluster) -> None:
    for fields in ({}, {"add_generation_prompt": False}):
        response = cluster.client.post("/tokenize", json={"model": MODEL, "messages": CHAT, **fields})
        assert response.status_code == 200, response.text
        expected = chat_prompt_token_ids(ChatCompletionRequest(model=MODEL, messages=CHAT, **fields),
                                         cluster.tokenizer)
        assert response.json()["tokens"] == expected and response.json()["count"] == len(expected)
    cluster.decode.reset()
    sent = cluster.client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert sent.status_code == 200, sent.text
    counted = cluster.client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert list(cluster.decode.requests[0].prompt_token_ids) == counted


def test_detokenize_keeps_special_tokens(cluster: Cluster) -> None:
    tokenizer = cluster.tokenizer
    ids = chat_prompt_token_ids(ChatCompletionRequest(model=MODEL, messages=CHAT), tokenizer)
    response = cluster.client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert response.json()["prompt"].startswith("<|im_start|>system")


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", "one of them"),
        ("/tokenize", {"model": MODEL}, 400, "prompt", "one of them"),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model", "does not exist"),
        ("/tokenize", {"prompt": "a\ud800"}, 400, "prompt", "lone surrogate"),
        ("/tokenize", {"prompt": "a\x00"}, 400, "prompt", "NUL"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a\x00"}]}, 400, "messages", "NUL"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs",
         "may not set messages"),
        ("/tokenize", {"messages": []}, 400, "messages", ""),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens", "must be in [0,"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens", ""),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model", "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(cluster: Cluster, path: str, body: dict, status: int, param: str,
                                    message: str) -> None:
    # json.dumps escapes a lone surrogate (\ud800), as a client's JSON may
    response = cluster.client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
