"""The offline API's sampling defaults, as vLLM's `LLM(generation_config="auto")`: the model's generation_config.json
gives `get_default_sampling_params()`, which `generate` and `chat` use when given no SamplingParams; `splitserve
generate` starts from them and sets only the flags given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.request.sampling_params import SamplingParams
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE

GENERATION_CONFIG = {"temperature": 0.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 3}  # top_k 50: HF's default
FROM_FILE = SamplingParams(temperature=0.0, top_p=0.9, max_tokens=3)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a generation_config.json."""
    folder = tmp_path_factory.mktemp("with_generation_config") / "tiny-llama"
    folder.mkdir()
    for path in tiny_model_dir.iterdir():
        (folder / path.name).symlink_to(path)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


def test_generate_without_params_samples_with_the_models_values(model_dir: Path) -> None:
    from engine.llm import LLM

    llm = LLM(model=str(model_dir), **TINY_ENGINE)  # type: ignore[arg-type]
    assert llm.get_default_sampling_params() == FROM_FILE
    outputs = llm.generate(PROMPTS[:2])
    assert [o.token_ids for o in outputs] == [o.token_ids for o in llm.generate(PROMPTS[:2], FROM_FILE)]
    assert all(1 <= len(o.token_ids) <= 3 for o in outputs)
    explicit = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert all(len(o.token_ids) == 5 for o in llm.generate(PROMPTS[:2], explicit))  # given params: as given


def test_vllm_reads_none_and_the_override_sets_its_keys(model_dir: Path, tiny_model_dir: Path) -> None:
    from engine.llm import LLM

    assert LLM(model=str(model_dir), generation_config="vllm",
               **TINY_ENGINE).get_default_sampling_params() == SamplingParams()  # type: ignore[arg-type]
    llm = LLM(model=str(model_dir), override_generation_config={"max_new_tokens": 2, "min_p": 0.1},
              **TINY_ENGINE)  # type: ignore[arg-type]
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.9, min_p=0.1, max_tokens=2)
    # Without a file, "auto" changes nothing.
    assert LLM(model=str(tiny_model_dir), **TINY_ENGINE).get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize(("setting", "override", "message"), [
    ("/no/such/folder", None, "--generation-config /no/such/folder: no such folder"),
    ("auto", {"temperature": "hot"}, "temperature must be a number"),
    ("auto", {"beam_width": 4}, "unknown keys beam_width"),
])
def test_a_bad_setting_is_a_clear_error_before_the_engine_builds(model_dir: Path, monkeypatch, setting, override,
                                                                 message) -> None:
    from engine import llm as llm_module

    def never(*args, **kwargs):  # noqa: ANN202
        raise AssertionError("the engine was built")

    monkeypatch.setattr(llm_module, "LLMEngine", never)
    with pytest.raises(ValueError, match=message):
        llm_module.LLM(model=str(model_dir), generation_config=setting, override_generation_config=override,
                       **TINY_ENGINE)  # type: ignore[arg-type]


def test_the_generate_command_sets_only_the_flags_given_over_the_models_values(
        model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.cli import main
    from engine.llm import LLM

    flags = [f"--{name.replace('_', '-')}={value}" for name, value in TINY_ENGINE.items()]

    def generated(*more: str) -> list[list[int]]:
        assert main(["generate", "--model", str(model_dir), *flags, "--prompt", PROMPTS[0], "--json", *more]) == 0
        return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]

    llm = LLM(model=str(model_dir), generation_config="vllm", **TINY_ENGINE)  # type: ignore[arg-type]
    assert generated() == [o.token_ids for o in llm.generate(PROMPTS[:1], FROM_FILE)]
    four = SamplingParams(temperature=0.0, top_p=0.9, max_tokens=4, ignore_eos=True)
    assert generated("--max-tokens", "4", "--ignore-eos") == [o.token_ids for o in llm.generate(PROMPTS[:1], four)]
    assert generated("--generation-config", "vllm", "--temperature", "0", "--max-tokens", "2", "--ignore-eos") == [
        o.token_ids for o in llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))]
    assert generated("--override-generation-config", '{"max_new_tokens": 1}') == [
        o.token_ids for o in llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, top_p=0.9, max_tokens=1))]
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--override-generation-config", "[1]"]) == 2
    assert "--override-generation-config holds no JSON object" in capsys.readouterr().err
