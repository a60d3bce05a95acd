"""The whole cluster as a user runs it: `splitserve serve` (real Ray, real workers, real model) in a subprocess,
talked to by the unmodified `openai` client, disaggregated over grpc (the default) and ipc (mapped buffers: their
own failure), and colocated. The other transports are served end to end elsewhere, each by a real `serve` too:
torch by test_serve_int8.py (exact answers) and tests/multihost/ (across hosts); inproc's workers in one host
process by tests/deploy/test_controller.py, and its handoffs by tests/cluster/test_workers.py. (Every transport
here cost the suite ~35 s a cluster, on its critical path.)

- Chat and completion answers, streamed and not, equal the offline engine's greedy output token for token.
- A workload with client-aborted streams and a KV handoff cut half-way (SPLITSERVE_FAULT_KV_CUTS) ends with every
  worker's KV blocks free, read from the router's /metrics; the cut request was retried and still exact.
- ipc: a prefill worker SIGKILLed mid-handoff (SPLITSERVE_FAULT_KV_STALL_FILE: half its blocks staged in the
  buffer the decode worker maps) costs at most that request (a 503, or the greedy answer, retried); the decode
  worker unmaps the dead worker's buffer and frees every block; the restarted worker answers exactly.
- Structured outputs and tool calls (colocated and over grpc): generated JSON schemas, `parse` with a pydantic
  model, a named tool choice, a guided choice (n = 3 too), a bad schema's 400; blocks freed after.
- n = 4 seeded choices, logit_bias, echo + logprobs (equal to HF transformers' prompt log-probabilities): the
  prompt prefilled once (on the prefill worker when disaggregated), every block free after, an aborted stream too.
- LoRA adapters (--enable-lora --lora-modules, and one loaded at run time): greedy answers under each equal the
  offline engine's with that adapter, its blocks serve only its own prompts, every block free after an unload.
- SIGINT stops it all, exit 0, no process left behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.request.sampling_params import SamplingParams
from prefill_worker.worker import FAULT_KV_STALL_ENV
from router.lora_api import RUNTIME_LORA_ENV
from tests.engine.lora.peft_adapter import make_adapter
from tests.cluster.worker_harness import engine_config
from tests.deploy.processes import ServeProcess, serve_argv, serving
from tests.engine.structured.schemas import generated_schema
from tests.kv_transfer.test_ipc_transport import memfd_inodes

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MAX_TOKENS = 24
COMPLETION_PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name three famous rivers and one fact about each."}]
LONG_PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 30  # ~370 tokens, 24 blocks
INTERRUPTED_PROMPT = "Tell me about the sea, the lighthouse and its keeper. " * 8  # ~100 tokens, 6 full blocks
ADMIN_TOKEN = "serve-openai-admin"


@pytest.fixture(scope="module")
def offline(smollm2_checkpoint) -> dict[str, list[int]]:
    """The offline engine's greedy token ids for each prompt, run alone."""
    from engine.llm_engine import LLMEngine

    tok = smollm2_checkpoint.tokenizer
    prompts = {
        "completion": tok.encode(COMPLETION_PROMPT),
        "chat": tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False),
        "long": tok.encode(LONG_PROMPT),
        "interrupted": tok.encode(INTERRUPTED_PROMPT),
    }
    engine = LLMEngine(engine_config(), smollm2_checkpoint)
    out: dict[str, list[int]] = {}
    for name, ids in prompts.items():
        engine.add_request(name, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        while engine.has_unfinished_requests():
            for result in engine.step():
                if result.finished:
                    out[name] = list(result.token_ids)
    return out


def _text(checkpoint, token_ids: list[int]) -> str:
    return checkpoint.tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def lora_dirs(smollm2_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Two PEFT adapters of SmolLM2: "smol" served from start-up, "late" loaded at run time."""
    root, weights = tmp_path_factory.mktemp("lora"), smollm2_checkpoint.weights
    layers = smollm2_checkpoint.config.num_layers
    return {"smol": make_adapter(root / "smol", weights, layers, rank=8, alpha=16, seed=7, b_std=0.04,
                                 targets=("q_proj", "v_proj", "gate_proj", "down_proj")),
            "late": make_adapter(root / "late", weights, layers, rank=4, alpha=8, seed=8, b_std=0.03)}


@pytest.fixture(scope="module", params=["grpc", "ipc", "colocated"])
def cluster(request, smollm2_gguf: str, tmp_path_factory, lora_dirs) -> Iterator[tuple[str, ServeProcess, str]]:
    mode = request.param
    pools = ["--colocated"] if mode == "colocated" else ["--prefill-workers", "1", "--decode-workers", "1",
                                                          "--kv-transport", mode]
    argv = serve_argv(smollm2_gguf, *pools, "--kv-cache-memory", "256MiB", "--max-model-len", "1024",
                      "--kv-transfer-timeout", "20", "--admin-token", ADMIN_TOKEN,
                      "--enable-lora", "--max-loras", "2", "--lora-modules", f"smol={lora_dirs['smol']}",
                      "--disagg-prefill-threshold", "0")  # short prompts through the KV transport too
    env = {"SPLITSERVE_FAULT_KV_CUTS": "1",  # the first handoff of 2+ blocks is cut half-way
           RUNTIME_LORA_ENV: "true",  # /v1/load_lora_adapter
           FAULT_KV_STALL_ENV: str(stall_file(tmp_path_factory, mode))}  # stalled while that file exists
    with serving(argv, stderr_path=tmp_path_factory.mktemp(mode) / "stderr.txt", env=env) as serve:
        yield mode, serve, serve.url


def stall_file(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Path:
    """While this file exists, the prefill worker of `mode`'s cluster stalls its handoffs half-way."""
    return tmp_path_factory.getbasetemp() / f"kv-stall-{mode}"


def client_for(url: str, timeout_s: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def test_openai_client_gets_exact_greedy_answers(cluster, offline, smollm2_checkpoint, smollm2_gguf) -> None:
    mode, _serve, url = cluster
    client = client_for(url)
    tok = smollm2_checkpoint.tokenizer
    assert smollm2_gguf in [m.id for m in client.models.list().data]

    # completion, not streamed, with logprobs: one token string per generated token
    completion = client.completions.create(model=smollm2_gguf, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=1)
    expected = offline["completion"]
    assert completion.choices[0].logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in expected]
    assert completion.choices[0].text == _text(smollm2_checkpoint, expected)
    assert completion.usage.completion_tokens == len(expected)

    # completion, streamed, with usage in the last chunk
    chunks = list(client.completions.create(model=smollm2_gguf, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _text(smollm2_checkpoint, expected)
    assert chunks[-1].usage.completion_tokens == len(expected)

    # a batch of two prompts: two requests, one answer, each choice its prompt's
    batch = client.completions.create(model=smollm2_gguf, prompt=[COMPLETION_PROMPT] * 2,
                                      max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in batch.choices] == [_text(smollm2_checkpoint, expected)] * 2
    assert batch.usage.completion_tokens == 2 * len(expected)

    # chat, not streamed, with logprobs
    chat = client.chat.completions.create(model=smollm2_gguf, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True)
    expected = offline["chat"]
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [
        tok.decode([t], skip_special_tokens=False) for t in expected
    ]
    assert chat.choices[0].message.content == _text(smollm2_checkpoint, expected)
    assert chat.choices[0].finish_reason == ("stop" if expected[-1] == tok.eos_token_id else "length")

    # chat, streamed
    stream = client.chat.completions.create(model=smollm2_gguf, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == _text(smollm2_checkpoint,
                                                                                            expected)

    # the Responses API over the same conversation, whole and streamed: the chat's answer
    response = client.responses.create(model=smollm2_gguf, input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.output_text == _text(smollm2_checkpoint, expected)
    assert response.usage.output_tokens == len(expected)
    events = list(client.responses.create(model=smollm2_gguf, input=CHAT, max_output_tokens=MAX_TOKENS,
                                          temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")

    # bad input: a clear 400, not a 500
    with pytest.raises(openai.BadRequestError, match="max_model_len|too long|context"):
        client.completions.create(model=smollm2_gguf, prompt="hello " * 2000, max_tokens=4)


def test_workload_with_aborts_and_a_cut_transfer_frees_every_block(cluster, offline, smollm2_checkpoint,
                                                                   smollm2_gguf) -> None:
    mode, _serve, url = cluster
    client = client_for(url)
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def exact(name: str) -> None:
        try:
            out = client.completions.create(model=smollm2_gguf, prompt=LONG_PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0)
            results[name] = out.choices[0].text
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def aborted(num_chunks: int) -> None:
        try:
            stream = client.completions.create(model=smollm2_gguf, prompt=f"{num_chunks}: {LONG_PROMPT}",
                                               max_tokens=500, temperature=0.8, stream=True)
            for i, _chunk in enumerate(stream):
                if i + 1 >= num_chunks:
                    break
            stream.close()  # the client goes away mid-stream
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=exact, args=(f"exact-{i}",)) for i in range(2)]
    threads += [threading.Thread(target=aborted, args=(n,)) for n in (1, 3, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    expected = _text(smollm2_checkpoint, offline["long"])
    assert results == {"exact-0": expected, "exact-1": expected}

    metrics = wait_until_every_block_is_free(url)
    used = metrics["splitserve:kv_blocks_used"]
    expected_workers = {"colocated-0"} if mode == "colocated" else {"prefill-0", "decode-0"}
    assert set(used) == expected_workers
    assert all(v > 0 for v in metrics["splitserve:kv_blocks_total"].values())
    if mode != "colocated":
        # the cut: the prefill worker counted a failed transfer, the router retried it (the request above or
        # one of the first test's, whichever handed off 2+ blocks first) and it still came out exact
        assert metrics["splitserve:kv_transfer_failures_total"]["prefill-0"] == 1
        assert metrics["splitserve:request_retries_total"] == {"aborted": 1}
        assert metrics["splitserve:kv_transfer_bytes_total"]["prefill-0"] > 0


def test_n_choices_logit_bias_and_echo_logprobs(cluster, offline, smollm2_checkpoint, smollm2_gguf,
                                                hf_prompt_logprobs) -> None:
    """n = 4 seeded choices (reproducible, distinct), logit_bias removing the greedy token and forcing another,
    echo + logprobs equal to HF's prompt log-probabilities; every block free after, an aborted n = 4 stream too."""
    _mode, _serve, url = cluster
    client = client_for(url)
    tok = smollm2_checkpoint.tokenizer

    def choices() -> list[str]:
        out = client.completions.create(model=smollm2_gguf, prompt=COMPLETION_PROMPT, max_tokens=4, n=4,
                                        temperature=1.0, seed=42, extra_body={"ignore_eos": True})
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert out.usage.prompt_tokens == len(tok.encode(COMPLETION_PROMPT))  # counted once
        assert out.usage.completion_tokens == 4 * 4
        return [c.text for c in out.choices]

    first = choices()
    assert len(set(first)) == 4, first  # per-choice seeds: distinct samples
    assert choices() == first  # and reproducible

    top = offline["completion"][0]  # the greedy answer's first token
    banned = client.completions.create(model=smollm2_gguf, prompt=COMPLETION_PROMPT, max_tokens=4, temperature=0,
                                       logprobs=0, logit_bias={str(top): -100})
    assert tok.decode([top], skip_special_tokens=False) not in banned.choices[0].logprobs.tokens
    forced_id = tok.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(model=smollm2_gguf, prompt=COMPLETION_PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == tok.decode([forced_id] * 3)

    echoed = client.completions.create(model=smollm2_gguf, prompt=COMPLETION_PROMPT, max_tokens=1, temperature=0,
                                       echo=True, logprobs=1)
    logprobs = echoed.choices[0].logprobs
    prompt_ids = tok.encode(COMPLETION_PROMPT)
    assert echoed.choices[0].text.startswith(COMPLETION_PROMPT)
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(prompt_ids) + 1
    assert logprobs.tokens[: len(prompt_ids)] == [tok.decode([t], skip_special_tokens=False) for t in prompt_ids]
    got = logprobs.token_logprobs[1 : len(prompt_ids)]
    assert max(abs(a - b) for a, b in zip(got, hf_prompt_logprobs, strict=True)) < 1e-4

    stream = client.completions.create(model=smollm2_gguf, prompt=COMPLETION_PROMPT, max_tokens=200, n=4,
                                       temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    indices = set()
    for chunk in stream:
        indices.update(c.index for c in chunk.choices)
        if len(indices) == 4:
            break
    stream.close()  # the client goes away while the four choices run
    wait_until_every_block_is_free(url)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_reference, smollm2_checkpoint) -> list[float]:
    """HF transformers' float32 log p(t_j | t_<j) over COMPLETION_PROMPT's tokens, j >= 1."""
    import torch

    ids = smollm2_checkpoint.tokenizer.encode(COMPLETION_PROMPT)
    with torch.no_grad():
        logits = hf_reference(torch.tensor([ids])).logits[0].float()  # [P, vocab]
    logprobs = logits.log_softmax(dim=-1)[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return logprobs.tolist()


def wait_until_every_block_is_free(url: str, timeout_s: float = 30) -> dict[str, dict[str, float]]:
    """Every worker's blocks free (the router polls loads every second), nothing running or waiting; the
    metrics that showed it."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url)
        used = metrics["splitserve:kv_blocks_used"]
        busy = {**metrics["splitserve:num_requests_running"], **metrics["splitserve:num_requests_waiting"]}
        if used and all(v == 0 for v in used.values()) and all(v == 0 for v in busy.values()):
            return metrics
        assert time.monotonic() < deadline, f"blocks still used: {used}, requests: {busy}"
        time.sleep(0.5)


class Rating(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=20)
    stars: int = pydantic.Field(ge=1, le=5)
    verdict: Literal["good", "bad"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}


@pytest.mark.timeout(900)  # with the cluster's start-up, which pytest-timeout counts too
# Colocated and one transport, not skipped on the others: the grammar crosses the handoff in the Prefill request,
# whatever the KV transport, so grpc covers torch, ipc and inproc.
@pytest.mark.parametrize("cluster", ["grpc", "colocated"], indirect=True)
def test_structured_outputs_and_tool_calls(cluster, smollm2_gguf) -> None:
    """JSON schemas (50 generated ones, at once; 50 others run offline in tests/engine/structured/), a pydantic model
    through `parse`, a named tool choice, a choice on completions, and a bad schema's 400; every block freed."""
    _mode, _serve, url = cluster
    client = client_for(url, timeout_s=600)  # ten requests at once on two shared cores
    schemas = [generated_schema(seed) for seed in range(100, 150)]

    def answer(schema: dict) -> tuple[dict, str, str]:
        chat = client.chat.completions.create(
            model=smollm2_gguf, messages=[{"role": "user", "content": "Describe an item as JSON."}], max_tokens=128,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema}})
        return schema, chat.choices[0].message.content, chat.choices[0].finish_reason

    with ThreadPoolExecutor(len(schemas)) as pool:
        for schema, content, finish_reason in pool.map(answer, schemas):
            assert finish_reason == "stop", content
            jsonschema.validate(json.loads(content), schema)

    parsed = client.chat.completions.parse(
        model=smollm2_gguf, messages=[{"role": "user", "content": "Rate the film Alien."}], response_format=Rating,
        max_tokens=64, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Rating)

    called = client.chat.completions.create(
        model=smollm2_gguf, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64,
        temperature=0)
    [call] = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    stream = client.chat.completions.create(  # the same, streamed: OpenAI's tool-call deltas
        model=smollm2_gguf, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64,
        temperature=0, stream=True)
    deltas = [d for chunk in stream if chunk.choices for d in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments

    completion = client.completions.create(model=smollm2_gguf, prompt="The sky is", max_tokens=8, temperature=0,
                                           extra_body={"guided_choice": ["blue", "green"]})
    assert completion.choices[0].text in ("blue", "green")
    choices = client.completions.create(model=smollm2_gguf, prompt="The sky is", max_tokens=8, temperature=1.0,
                                        seed=7, n=3, extra_body={"guided_choice": ["blue", "green"]})
    assert [c.index for c in choices.choices] == [0, 1, 2]  # n > 1: each choice under its own matcher
    assert all(c.text in ("blue", "green") for c in choices.choices), choices.choices

    with pytest.raises(openai.BadRequestError, match="invalid json_schema.*objec"):
        client.chat.completions.create(model=smollm2_gguf, messages=CHAT, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objec"}}})
    wait_until_every_block_is_free(url)


def scrape(url: str) -> dict[str, dict[str, float]]:
    """/metrics as {sample name: {the worker (or reason) label: value}}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.labels.get("worker", sample.labels.get("reason", ""))
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def _pools(url: str) -> dict[str, dict]:
    """The admin API's worker of each role (one of each; none while it restarts)."""
    response = httpx.get(f"{url}/admin/pools", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert response.status_code == 200, response.text
    workers = response.json()["workers"]
    assert len({w["role"] for w in workers}) == len(workers), workers
    return {w["role"]: w for w in workers}


def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.parametrize("cluster", ["ipc"], indirect=True)  # the buffers the workers share are ipc's
def test_a_prefill_worker_killed_mid_handoff_leaves_no_mapped_buffer_and_no_block(
        cluster, offline, smollm2_checkpoint, smollm2_gguf, tmp_path_factory) -> None:
    """See the module docstring: the decode worker maps the prefill worker's staging buffer, which that worker dies
    writing; the mapping must go with it (it would hold the dead worker's memory), and so must the reservation."""
    mode, _serve, url = cluster
    client = client_for(url)
    stall = stall_file(tmp_path_factory, mode)
    interrupted = _text(smollm2_checkpoint, offline["interrupted"])

    def complete(prompt: str) -> str:
        return client.completions.create(model=smollm2_gguf, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text

    assert complete(LONG_PROMPT) == _text(smollm2_checkpoint, offline["long"])
    before = _pools(url)
    decode_pid, prefill = before["decode"]["pid"], before["prefill"]
    assert memfd_inodes(decode_pid) == memfd_inodes(prefill["pid"]) != set()  # its staging buffer, mapped

    outcome: list[str | BaseException] = []
    stall.write_text("")
    worker = threading.Thread(target=lambda: outcome.append(_catch(complete, INTERRUPTED_PROMPT)))
    worker.start()
    try:
        _wait(lambda: stall.read_text().startswith("stalled "), 60, "the handoff never stalled")
        dead_buffers = memfd_inodes(prefill["pid"])
        assert dead_buffers and dead_buffers <= memfd_inodes(decode_pid)  # half-staged where the decode reads
        _wait(lambda: _load(url, "decode-0")["kv_blocks_used"] > 0, 10, "no block reserved for the handoff")
        os.kill(prefill["pid"], signal.SIGKILL)
    finally:
        stall.unlink()
        worker.join(300)
    # the request: its greedy answer (retried once the worker is back) or a 503, never another answer
    [result] = outcome
    if isinstance(result, openai.APIStatusError):
        assert result.status_code == 503, result
    else:
        assert result == interrupted

    _wait(lambda: not dead_buffers & memfd_inodes(decode_pid), 30, "the dead worker's buffer is still mapped")

    def restarted() -> bool:
        now = _pools(url).get("prefill")
        return bool(now and now["state"] == "serving" and now["pid"] != prefill["pid"] and now["load"]
                    and now["load"]["healthy"])

    _wait(restarted, 120, "the prefill worker was not restarted")
    # one block (its first 2-block handoff would be cut: the restarted worker has SPLITSERVE_FAULT_KV_CUTS too)
    assert complete(COMPLETION_PROMPT) == _text(smollm2_checkpoint, offline["completion"])
    wait_until_every_block_is_free(url)
    assert memfd_inodes(decode_pid) <= memfd_inodes(_pools(url)["prefill"]["pid"])  # a live worker's, if any
    assert _pools(url)["decode"]["pid"] == decode_pid  # the decode worker lived through it all


def _catch(call, *args):  # type: ignore[no-untyped-def]
    try:
        return call(*args)
    except openai.APIError as exc:
        return exc


def _load(url: str, worker_id: str) -> dict:
    return next(w["load"] for w in _pools(url).values() if w["worker_id"] == worker_id)


def test_lora_adapters_answer_as_the_offline_engine_with_them(cluster, smollm2_checkpoint, smollm2_gguf,
                                                              lora_dirs) -> None:
    import dataclasses

    from engine.llm_engine import LLMEngine

    _mode, _serve, url = cluster
    client = client_for(url)
    tok = smollm2_checkpoint.tokenizer
    prompt = ("The old lighthouse stood on the rocks at the end of the island. Every evening the keeper climbed its "
              "stairs, lit the lamp, and wrote in her log. Tonight the sea was")  # 37 tokens: 2 full blocks
    modules = tuple((name, str(path)) for name, path in lora_dirs.items())
    engine = LLMEngine(dataclasses.replace(engine_config(), enable_lora=True, lora_modules=modules),
                       smollm2_checkpoint)
    want: dict[str | None, list[int]] = {}
    for lora in (None, "smol", "late"):
        engine.add_request(str(lora), tok.encode(prompt), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           lora_name=lora)
        while engine.has_unfinished_requests():
            want |= {None if o.request_id == "None" else o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert len({tuple(v) for v in want.values()}) == 3, "the adapters must change the answer"

    models = {m.id: m for m in client.models.list().data}
    assert models["smol"].parent == smollm2_gguf and models["smol"].root == str(lora_dirs["smol"])
    base = client.completions.create(model=smollm2_gguf, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert base.choices[0].text == _text(smollm2_checkpoint, want[None])
    cached = []
    for _ in range(2):  # the first under the adapter hits none of the base model's blocks; the second its own
        answer = client.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert answer.model == "smol" and answer.choices[0].text == _text(smollm2_checkpoint, want["smol"])
        cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[0] == 0 and cached[1] > 0, cached
    stream = client.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == _text(smollm2_checkpoint, want["smol"])

    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(lora_dirs["late"])},
                        timeout=120)
    assert loaded.status_code == 200, loaded.text
    late = client.completions.create(model="late", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert late.choices[0].text == _text(smollm2_checkpoint, want["late"])
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=prompt, max_tokens=2)
    metrics = wait_until_every_block_is_free(url)
    assert metrics["splitserve:lora_requests_info"], "every worker reports its --max-loras"
