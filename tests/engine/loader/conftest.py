"""Shared fixtures: tiny random-weight HF models and their GGUF files (helpers in `tiny_checkpoints`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.loader.tiny_checkpoints import (
    VARIANTS,
    TinyModel,
    build_tiny_model,
    write_tiny_gguf,
)


@pytest.fixture(scope="session", params=VARIANTS)
def tiny_model(request: pytest.FixtureRequest) -> TinyModel:
    return build_tiny_model(request.param)


@pytest.fixture(scope="session")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small valid GGUF (tied Llama, F32) for the corruption tests to damage."""
    return write_tiny_gguf(build_tiny_model("llama_tied"), tmp_path_factory.mktemp("gguf") / "tiny.gguf")
