"""A batch of prompts in one /v1/completions request, through the official `openai` client against the router (fake
workers behind it): each prompt is a request of its own to the workers, and the answer is one completion with
prompt i's choices at i * n + j, the usage summed; streamed, chunks of every prompt under one id, one usage chunk,
one [DONE]; a failing prompt fails the batch."""

from __future__ import annotations

import json

import openai
import pytest

from router.batched_completions import merge_bodies, sum_usage
from tests.router.conftest import MODEL, Cluster
from tests.router.fake_worker import Script


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=30.0)


def test_each_prompt_is_a_request_and_the_answer_is_one_completion(client: openai.OpenAI, cluster: Cluster) -> None:
    completion = client.completions.create(model=MODEL, prompt=["Say hi", "Hey", "Greetings, friend"], max_tokens=5,
                                           n=2, seed=3)
    assert [(c.index, c.text) for c in completion.choices] == [(i, "Hello") for i in range(6)]
    prompts = sorted(list(r.prompt_token_ids) for r in cluster.decode.requests)
    assert len(prompts) == 3 and len({len(p) for p in prompts}) == 3  # three requests, one per prompt
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == sum(map(len, prompts)) and completion.usage.completion_tokens == 30
    assert completion.id.startswith("cmpl-")
    ids = client.completions.create(model=MODEL, prompt=[[72, 105], [72, 101, 121]], max_tokens=2)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage is not None and ids.usage.prompt_tokens == 5


def test_a_streamed_batch_interleaves_its_prompts_under_one_id(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=["Say hi", "Hey"], max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "Hello world", 1: "Hello world"}
    assert len({chunk.id for chunk in chunks}) == 1
    usage_chunks = [chunk for chunk in chunks if chunk.usage is not None and not chunk.choices]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and usage_chunks[0].usage.completion_tokens == 22


def test_a_failing_prompt_fails_the_batch(client: openai.OpenAI, cluster: Cluster) -> None:
    # the first call fails at its third token; the other stops after three and waits until it is cancelled
    cluster.decode.script = Script(error_after=2, error_times=1, hang_after=3)
    with pytest.raises(openai.APIError):
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=8)
    # the other prompt's request was cancelled, not cut and resumed (a closed stream that is still read migrates)
    assert cluster.decode.wait_for(lambda worker: len(worker.cancelled) == 1)
    assert len(cluster.decode.requests) == 2
    cluster.decode.script = Script(error_after=2)
    answer = cluster.client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "stream": True})
    events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert "error" in json.loads(events[-2][len("data: "):]) and events[-1] == "data: [DONE]"
    # the other prompts' requests were cancelled, not left to migrate: the worker still serves
    cluster.decode.script = Script()
    assert len(client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2).choices) == 2


def test_merging_sums_the_usage_and_reindexes_the_choices() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 1}}
    body = {"id": "cmpl-a", "choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}], "usage": usage}
    merged = merge_bodies([body, {**body, "id": "cmpl-b"}], n=2)
    assert merged["id"] == "cmpl-a" and [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    assert merged["usage"] == sum_usage([usage, usage]) == {
        "prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}
