"""Bad input is refused with an error naming the problem, before it can hold a KV block or hurt other requests.

Engine level (`LLMEngine.add_request`), offline API (`LLM.generate`, `LLM(model=...)`) and model files on disk.
The CLI's side of the same refusals is in `test_cli.py`.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.loader.errors import ModelLoadError, UnknownModelError
from engine.model.config import UnsupportedArchitectureError
from tests.engine.tiny_model import (
    PROMPTS,
    TINY_ENGINE,
    assert_no_blocks_held,
    drain,
    finals,
    greedy,
    make_engine,
    write_gguf,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _assert_engine_still_serves(engine) -> None:  # noqa: ANN001
    engine.add_request("after-bad-input", PROMPTS[0], greedy(max_tokens=4))
    out = finals(drain(engine))["after-bad-input"]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert_no_blocks_held(engine)


# -- prompts and sampling params, at the engine ---------------------------------------------------------------

# A prompt is given as itself or as a function of the vocabulary size; so is the message.
BAD_PROMPTS = [
    pytest.param("", "prompt is empty", id="empty-text"),
    pytest.param([], "prompt is empty", id="empty-ids"),
    pytest.param(lambda v: [5, v, 7], lambda v: rf"out of range \[0, {v}\): \[{v}\]", id="id-past-vocab"),
    pytest.param([-1], r"out of range \[0, \d+\): \[-1\]", id="negative-id"),
    pytest.param([5, 1.5], "integer token ids, got \\[5, 1.5\\]", id="float-id"),
    pytest.param([5, "7"], "integer", id="str-id"),
    pytest.param(5, "integer", id="not-a-sequence"),
    pytest.param([5] * 128, "prompt has 128 tokens.*max_model_len=128", id="fills-max-model-len"),
    pytest.param([5] * 1000, "prompt has 1000 tokens.*max_model_len=128", id="longer-than-max-model-len"),
    pytest.param("word " * 300, "max_model_len=128", id="long-text"),
]


@pytest.mark.parametrize(("prompt", "message"), BAD_PROMPTS)
def test_bad_prompt_is_refused_without_holding_blocks(tiny_engine, prompt, message) -> None:
    vocab_size = tiny_engine.model_config.vocab_size
    prompt = prompt(vocab_size) if callable(prompt) else prompt
    message = message(vocab_size) if callable(message) else message

    with pytest.raises(ValueError, match=message):
        tiny_engine.add_request("bad", prompt, greedy())

    assert_no_blocks_held(tiny_engine)
    assert tiny_engine.stats().num_prompt_tokens == 0
    _assert_engine_still_serves(tiny_engine)


BAD_PARAMS = [
    pytest.param(dict(max_tokens=0), "max_tokens", id="max_tokens=0"),
    pytest.param(dict(max_tokens=-3), "max_tokens", id="max_tokens<0"),
    pytest.param(dict(temperature=-1.0), "temperature", id="temperature<0"),
    pytest.param(dict(temperature=math.nan), "temperature", id="temperature=nan"),
    pytest.param(dict(top_p=0.0), "top_p", id="top_p=0"),
    pytest.param(dict(top_p=1.5), "top_p", id="top_p=1.5"),
    pytest.param(dict(top_p=math.nan), "top_p", id="top_p=nan"),
    pytest.param(dict(top_k=-2), "top_k", id="top_k<-1"),
    pytest.param(dict(min_p=1.5), "min_p", id="min_p>1"),
    pytest.param(dict(repetition_penalty=0.0), "repetition_penalty", id="repetition_penalty=0"),
    pytest.param(dict(presence_penalty=3.0), "presence_penalty", id="presence_penalty>2"),
    pytest.param(dict(min_tokens=9, max_tokens=4), "min_tokens", id="min_tokens>max_tokens"),
    pytest.param(dict(logprobs=21), "logprobs must be in \\[0, 20\\] \\(the engine's --max-logprobs", id="logprobs>20"),
    pytest.param(dict(prompt_logprobs=21), "prompt_logprobs must be in \\[0, 20\\]", id="prompt_logprobs>20"),
    pytest.param(dict(bad_words=["\t"]), "bad_words entries must hold more than whitespace", id="blank-bad-word"),
    pytest.param(dict(stop=["ok", ""]), "stop strings", id="empty-stop-string"),
    pytest.param(dict(stop_token_ids=[-1]), "stop_token_ids", id="negative-stop-id"),
    pytest.param(dict(seed=2**64), "seed", id="seed-too-large"),
    pytest.param(dict(seed=-(2**63) - 1), "seed", id="seed-too-small"),
    pytest.param(dict(n=0), "n must be in", id="n=0"),
]


@pytest.mark.parametrize(("params", "message"), BAD_PARAMS)
def test_bad_sampling_params_are_refused_without_holding_blocks(tiny_engine, params: dict, message: str) -> None:
    fields = {"temperature": 1.0, "max_tokens": 4, **params}

    with pytest.raises(ValueError, match=message):
        tiny_engine.add_request("bad", PROMPTS[0], SamplingParams(**fields))

    assert_no_blocks_held(tiny_engine)
    _assert_engine_still_serves(tiny_engine)


def test_max_logprobs_is_the_engines_cap_and_minus_one_its_vocabulary(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint, max_logprobs=2)
    with pytest.raises(ValueError, match="logprobs must be in \\[0, 2\\]"):
        engine.add_request("bad", PROMPTS[0], greedy(logprobs=3))
    engine = make_engine(tiny_checkpoint, max_logprobs=-1)
    vocab_size = engine.model_config.vocab_size
    engine.add_request("all", PROMPTS[0], greedy(max_tokens=2, logprobs=vocab_size))
    out = finals(drain(engine))["all"]
    assert all(len(entry.top) == vocab_size for entry in out.logprobs)
    with pytest.raises(ValueError, match=f"logprobs must be in \\[0, {vocab_size}\\]"):
        engine.add_request("bad", PROMPTS[0], greedy(logprobs=vocab_size + 1))
    assert_no_blocks_held(engine)
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        make_engine(tiny_checkpoint, max_logprobs=-2)


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        pytest.param(PROMPTS[2], dict(seed=2**64), id="seed-too-large"),
        pytest.param([5, 6.0], {}, id="float-token-id"),
    ],
)
def test_a_bad_request_never_reaches_a_step_shared_with_good_ones(tiny_engine, prompt, params: dict) -> None:
    # Both were once accepted, then failed inside the step (torch's seed and embedding), erroring every request
    # scheduled with them.
    tiny_engine.add_request("good", PROMPTS[1], greedy(max_tokens=6))
    with pytest.raises(ValueError):
        tiny_engine.add_request("bad", prompt, SamplingParams(temperature=1.0, max_tokens=6, **params))

    out = finals(drain(tiny_engine))
    assert list(out) == ["good"]
    assert out["good"].finish_reason == "length" and out["good"].error is None
    assert_no_blocks_held(tiny_engine)


def test_duplicate_request_id_is_refused_and_the_first_one_runs_on(tiny_engine) -> None:
    tiny_engine.add_request("same", PROMPTS[0], greedy())
    with pytest.raises(ValueError, match="'same' is already in use"):
        tiny_engine.add_request("same", PROMPTS[1], greedy())

    out = finals(drain(tiny_engine))["same"]
    assert out.prompt_token_ids == tiny_engine.tokenizer.encode(PROMPTS[0]) and out.finish_reason == "length"
    assert_no_blocks_held(tiny_engine)


# -- the offline API --------------------------------------------------------------------------------------------



@pytest.mark.parametrize(
    ("bad_prompt", "message"),
    [
        pytest.param("", "prompt is empty", id="empty-text"),
        pytest.param([], "prompt is empty", id="empty-ids"),
        pytest.param([1, 2, 10**6], "out of range", id="id-past-vocab"),
        pytest.param("word " * 300, "max_model_len", id="too-long"),
    ],
)
def test_generate_with_a_bad_prompt_mid_batch_queues_nothing(tiny_llm, bad_prompt, message: str) -> None:
    engine = tiny_llm.engine
    prompts = [PROMPTS[0], tiny_llm.tokenizer.encode(PROMPTS[1]), bad_prompt, PROMPTS[3]]

    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(prompts, greedy())

    assert_no_blocks_held(engine)
    stats = engine.stats()  # validated before queueing: the good prompts never reached the engine either
    assert stats.finished == [] and stats.num_prompt_tokens == 0
    outs = tiny_llm.generate([PROMPTS[0], PROMPTS[3]], greedy())
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert_no_blocks_held(engine)


def test_generate_with_bad_params_mid_list_queues_nothing(tiny_llm) -> None:
    params = [greedy(), SamplingParams(top_p=1.5), greedy()]

    with pytest.raises(ValueError, match="top_p"):
        tiny_llm.generate(PROMPTS[:3], params)

    assert_no_blocks_held(tiny_llm.engine)
    assert tiny_llm.engine.stats().finished == []


@pytest.mark.parametrize("num_params", [0, 2, 4])
def test_generate_with_mismatched_params_list_length(tiny_llm, num_params: int) -> None:
    with pytest.raises(ValueError, match=f"got {num_params} SamplingParams for 3 prompts"):
        tiny_llm.generate(PROMPTS[:3], [greedy()] * num_params)

    assert_no_blocks_held(tiny_llm.engine)


def test_chat_with_an_unknown_role_is_refused(tiny_llm) -> None:
    with pytest.raises(ValueError, match="unknown role"):
        tiny_llm.chat([{"role": "wizard", "content": "hi"}], greedy())

    assert_no_blocks_held(tiny_llm.engine)


# -- model names and files ---------------------------------------------------------------------------------------


def test_unknown_model_name_lists_the_known_names() -> None:
    from engine import LLM
    from engine.loader.checkpoint import load_checkpoint

    for load in (lambda: LLM(model="no-such-model"), lambda: load_checkpoint("no-such-model")):
        with pytest.raises(UnknownModelError) as info:
            load()
        message = str(info.value)
        assert "'no-such-model'" in message and "known names: smollm2-135m" in message


def _truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def _scribble(path: Path, offset: int, num_bytes: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + num_bytes] = b"\xa7" * num_bytes
    path.write_bytes(bytes(data))


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def hf_dir_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param(lambda p: _truncate(p, 0.5), "truncated", id="truncated-half"),
        pytest.param(lambda p: _truncate(p, 0.02), "truncated", id="truncated-header"),
        pytest.param(lambda p: _scribble(p, 0, 4), "not a GGUF file", id="bad-magic"),
        pytest.param(lambda p: _scribble(p, 8, 16), "corrupt", id="corrupt-header"),
    ],
)
def test_damaged_gguf_is_refused_naming_the_file(gguf_file: Path, damage, message: str) -> None:
    from engine import LLM

    damage(gguf_file)
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(gguf_file), **TINY_ENGINE)
    assert str(gguf_file) in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: _truncate(p, 0.5), id="truncated-half"),
        pytest.param(lambda p: _truncate(p, 0.001), id="truncated-header"),
        pytest.param(lambda p: _scribble(p, 0, 8), id="corrupt-header-length"),
        pytest.param(lambda p: _scribble(p, 9, 40), id="corrupt-header-json"),
    ],
)
def test_damaged_safetensors_is_refused_naming_the_file(hf_dir_copy: Path, damage) -> None:
    from engine import LLM

    weights = hf_dir_copy / "model.safetensors"
    damage(weights)
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(hf_dir_copy), **TINY_ENGINE)
    assert str(weights) in str(info.value) and "cannot read safetensors" in str(info.value)


def test_unsupported_gguf_architecture_is_refused_by_name(tmp_path: Path) -> None:
    from engine import LLM

    path = write_gguf(tmp_path / "phi3.gguf", architecture="phi3")
    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported model architecture 'phi3'; supported: llama"):
        LLM(model=str(path), **TINY_ENGINE)


def test_unsupported_hf_architecture_is_refused_by_name(hf_dir_copy: Path) -> None:
    from engine import LLM

    config_path = hf_dir_copy / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "model_type": "gpt_neox"}))
    with pytest.raises(UnsupportedArchitectureError, match="'gpt_neox'"):
        LLM(model=str(hf_dir_copy), **TINY_ENGINE)


def test_engine_config_too_small_for_one_request_is_refused(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=128"):
        make_engine(tiny_checkpoint, num_kv_blocks=8)  # 8 blocks x 4 tokens < 128
    with pytest.raises(ValueError, match="exceeds the model's context length 512"):
        make_engine(tiny_checkpoint, max_model_len=1024, num_kv_blocks=256)
