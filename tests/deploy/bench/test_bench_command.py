"""`splitserve bench`'s bad input: each a clear message and exit 2, before any load is sent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deploy import cli
from deploy.bench.command import load_points

# An executable that is not AIPerf: the checks before AIPerf runs must not need it installed.
FAKE_AIPERF = ["--aiperf", "/bin/true"]


def bench(tmp_path: Path, *flags: str) -> list[str]:
    return ["bench", "--url", "http://127.0.0.1:1", "--out", str(tmp_path / "out"), *flags]


@pytest.mark.parametrize(("flags", "message"), [
    ([], "bench needs a load: --rate R (requests/s) or --concurrency C"),
    (["--rate", "0"], "requests/s must be positive"),
    (["--concurrency", "2", "--sweep", "1.5"], "whole numbers >= 1"),
    (["--rate", "1", "--sweep", "2,x"], "--sweep: comma-separated numbers"),
    (["--rate", "1", "--num-requests", "0"], "--num-requests must be at least 1"),
    (["--rate", "1", "--ttft-slo", "-1"], "--ttft-slo must be positive"),
    (["--rate", "1", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--rate", "1", "--workload", "poisson"], "--workload: one of random, shared-prefix, chat or a FILE.jsonl"),
    (["--rate", "1", "--workload", "missing.jsonl"], "--workload missing.jsonl: no such file"),
    (["--rate", "1", "--aiperf", "/nonexistent/aiperf"], "--aiperf /nonexistent/aiperf: not an executable file"),
    (["--rate", "1", *FAKE_AIPERF], "--url http://127.0.0.1:1: no OpenAI server answers GET /v1/models"),
])
def test_bad_input_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                     message: str) -> None:
    assert cli.main(bench(tmp_path, *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("content", "message"), [
    ('{"text": "fine"}\nnot json\n', "line 2 is not JSON"),
    ('{"prompt": "no text field"}\n', 'line 1 is not an object with "text", "texts" or "turns"'),
    ("\n\n", "no records"),
    ('{"text": "a"}\n{"turns": [{"text": "b"}]}\n', "mixes single-turn records and records with \"turns\""),
])
def test_a_bad_workload_file_names_its_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                             message: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(content)
    assert cli.main(bench(tmp_path, "--rate", "1", "--workload", str(path), *FAKE_AIPERF)) == 2
    err = capsys.readouterr().err
    assert f"--workload {path}" in err and message in err, err


def test_without_aiperf_the_error_says_how_to_install_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.bench import aiperf_driver

    monkeypatch.delenv("AIPERF", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(aiperf_driver, "VENV_AIPERF", tmp_path / "none")
    assert cli.main(bench(tmp_path, "--rate", "1")) == 2
    assert "AIPerf not found" in (err := capsys.readouterr().err) and "pip install aiperf" in err


def test_without_matplotlib_the_error_names_the_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert cli.main(bench(tmp_path, "--rate", "1", *FAKE_AIPERF)) == 2
    assert "pip install 'splitserve[bench]'" in capsys.readouterr().err


def test_sweep_points_are_the_loads_value_and_the_sweeps_ascending_once() -> None:
    assert load_points(1.0, None, "4,0.5,1") == ("rate", [0.5, 1.0, 4.0])
    assert load_points(None, 2, "8, 4") == ("concurrency", [2.0, 4.0, 8.0])
    assert load_points(0.5, None, None) == ("rate", [0.5])


def test_rate_and_concurrency_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(bench(tmp_path, "--rate", "1", "--concurrency", "2"))
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
