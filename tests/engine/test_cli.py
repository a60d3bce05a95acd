"""`splitserve generate`: output on good input (tiny model in-process; the real model in a real process, slow),
and on bad input a non-zero exit with one `splitserve: error: ...` line and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import main
from engine import SamplingParams
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE, write_gguf

pytestmark = pytest.mark.usefixtures("torch_single_thread")

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in TINY_ENGINE.items()]


def _splitserve_command() -> list[str]:
    """The installed console script when the venv has one, else the same entry point through `python -m`."""
    script = Path(sys.executable).with_name("splitserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "deploy.cli"]


def _assert_one_line_error(capsys: pytest.CaptureFixture[str], rc: int, *fragments: str) -> str:
    captured = capsys.readouterr()
    assert rc != 0
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitserve: error: "), captured.err
    assert "Traceback" not in captured.err
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


# -- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        pytest.param(["--temperature", "-1"], "temperature must be >= 0, got -1.0", id="temperature<0"),
        pytest.param(["--temperature", "nan"], "temperature", id="temperature=nan"),
        pytest.param(["--top-p", "0"], "top_p must be in (0, 1], got 0.0", id="top_p=0"),
        pytest.param(["--top-p", "1.5"], "top_p", id="top_p=1.5"),
        pytest.param(["--max-tokens", "0"], "max_tokens must be at least 1, got 0", id="max_tokens=0"),
        pytest.param(["--logprobs", "99"], "logprobs", id="logprobs=99"),
    ],
)
def test_bad_sampling_flags_fail_before_loading_the_model(
    capsys: pytest.CaptureFixture[str], flags: list[str], fragment: str
) -> None:
    # --model names nothing loadable: reaching the loader would fail with a different message.
    rc = main(["generate", "--model", "not-loaded", "--prompt", "hi", *flags])

    _assert_one_line_error(capsys, rc, fragment)


def test_unknown_model_lists_the_known_names(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", "no-such-model", "--prompt", "hi"])

    _assert_one_line_error(capsys, rc, "unknown model 'no-such-model'", "known names: smollm2-135m")


def test_damaged_model_file_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:1000])

    rc = main(["generate", "--model", str(path), "--prompt", "hi"])

    _assert_one_line_error(capsys, rc, str(path), "truncated")


def test_unsupported_architecture_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["generate", "--model", str(write_gguf(tmp_path / "phi3.gguf", "phi3")), "--prompt", "hi"])

    _assert_one_line_error(capsys, rc, "unsupported model architecture 'phi3'")


def test_prompt_too_long_is_one_error_line(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    rc = main(["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--prompt", "ok", "--prompt", "word " * 300])

    _assert_one_line_error(capsys, rc, "max_model_len=128")


def test_engine_flags_that_cannot_fit_a_request_are_one_error_line(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    rc = main(["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--num-kv-blocks=4", "--prompt", "hi"])

    _assert_one_line_error(capsys, rc, "cannot hold one request")


def test_unparsable_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "hi", "--temperature", "warm"])

    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --temperature: invalid float value: 'warm'" in err and "Traceback" not in err


def test_bad_flag_in_a_real_process_exits_non_zero_with_one_line() -> None:
    result = subprocess.run(
        [*_splitserve_command(), "generate", "--prompt", "hi", "--temperature", "-1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )

    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["splitserve: error: temperature must be >= 0, got -1.0"]


# -- good input ----------------------------------------------------------------------------------------------------


def test_sampling_flags_set_their_fields() -> None:
    """The flags SamplingParams' field table names, each setting its field; none given: the fields' defaults."""
    from deploy.cli import build_parser
    from engine.generate_command import sampling_params_from_flags

    def parse(*flags: str) -> SamplingParams:
        return sampling_params_from_flags(build_parser().parse_args(["generate", "--prompt", "hi", *flags]))

    assert parse() == SamplingParams()
    assert parse("--max-tokens", "5", "--temperature", "0", "--top-p", "0.5", "--top-k", "3", "--min-p", "0.25",
                 "--repetition-penalty", "1.5", "--presence-penalty", "1", "--frequency-penalty", "-1", "--stop", "a",
                 "--stop", "b", "--ignore-eos", "--logprobs", "2", "--request-seed", "7") == SamplingParams(
        max_tokens=5, temperature=0.0, top_p=0.5, top_k=3, min_p=0.25, repetition_penalty=1.5, presence_penalty=1.0,
        frequency_penalty=-1.0, stop=["a", "b"], ignore_eos=True, logprobs=2, seed=7)



def _json_lines(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    captured = capsys.readouterr()
    assert captured.err == ""
    return [json.loads(line) for line in captured.out.splitlines()]


def test_json_output_matches_llm_generate(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tiny_llm) -> None:
    rc = main(["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
               "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--json"])

    assert rc == 0
    printed = _json_lines(capsys)
    expected = tiny_llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert printed == [{"text": o.text, "token_ids": o.token_ids} for o in expected]
    assert all(len(p["token_ids"]) == 6 for p in printed)


def test_sampling_flags_reach_the_request(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tiny_llm) -> None:
    rc = main(["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--prompt", PROMPTS[2], "--max-tokens", "10",
               "--temperature", "0.8", "--top-p", "0.9", "--top-k", "100", "--request-seed", "42", "--ignore-eos",
               "--json"])

    assert rc == 0
    (printed,) = _json_lines(capsys)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=100, seed=42, max_tokens=10, ignore_eos=True)
    (expected,) = tiny_llm.generate(PROMPTS[2], params)
    assert printed == {"text": expected.text, "token_ids": expected.token_ids}


def test_chat_and_plain_text_output(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tiny_llm) -> None:
    rc = main(["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--chat", "--prompt", "Hello world",
               "--max-tokens", "5", "--temperature", "0", "--ignore-eos"])

    assert rc == 0
    captured = capsys.readouterr()
    (expected,) = tiny_llm.chat([{"role": "user", "content": "Hello world"}],
                                SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert captured.out == expected.text + "\n" and captured.err == ""


# -- the real model ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_json_output_matches_llm_generate(
    smollm2_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    # One torch thread: on a busy 2-core machine two threads made this run 40 s instead of 12 s.
    command = [*_splitserve_command(), "generate", "--model", "smollm2-135m", "--max-tokens", "8",
               "--temperature", "0", "--json", "--num-threads", "1"]
    for prompt in prompts:
        command += ["--prompt", prompt]

    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)

    assert result.returncode == 0, result.stderr
    printed = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(printed) == len(prompts) and all(set(p) == {"text", "token_ids"} for p in printed)

    # The same through the offline API, reusing the already loaded checkpoint instead of loading it again.
    import engine.loader.checkpoint
    from engine import LLM

    loaded = []

    def shared_checkpoint(model: str, dtype):  # noqa: ANN001, ANN202
        assert model == "smollm2-135m"
        loaded.append(model)
        return smollm2_checkpoint

    # Where the engine's loader (load_engine_checkpoint) looks it up.
    monkeypatch.setattr(engine.loader.checkpoint, "load_checkpoint", shared_checkpoint)
    expected = LLM(model="smollm2-135m", num_kv_blocks=128, max_model_len=2048).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8)
    )
    assert loaded == ["smollm2-135m"]
    assert [p["token_ids"] for p in printed] == [o.token_ids for o in expected]
    assert [p["text"] for p in printed] == [o.text for o in expected]
    assert all(1 <= len(p["token_ids"]) <= 8 for p in printed)
    assert "Paris" in printed[0]["text"]
