"""Engine-level fixtures: the tiny random-weight checkpoint (fast tests) and one shared real SmolLM2 checkpoint
(slow tests). Engines are cheap to build from a loaded checkpoint; build a fresh one per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.engine.tiny_model import TINY_ENGINE, make_engine, write_tiny_checkpoint

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.loader.checkpoint import Checkpoint


@pytest.fixture
def torch_single_thread() -> Iterator[None]:
    """One torch thread for the test, restored after. The tiny model's ops are far too small to split, and on a
    busy 2-core machine OpenMP's thread hand-offs made each step ~100x slower (200 ms instead of 2 ms)."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny HF checkpoint directory (config.json, model.safetensors, tokenizer files with a chat template)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model_dir: Path) -> Checkpoint:
    from engine.loader.checkpoint import load_checkpoint

    return load_checkpoint(str(tiny_model_dir))


@pytest.fixture
def tiny_engine(tiny_checkpoint: Checkpoint) -> LLMEngine:
    """A fresh engine over the tiny model: block_size 4, 64 KV blocks, max_model_len 128."""
    return make_engine(tiny_checkpoint)


@pytest.fixture
def tiny_llm(tiny_model_dir: Path) -> LLM:
    """The offline API over the tiny model (it loads the checkpoint itself: milliseconds)."""
    from engine.llm import LLM

    return LLM(model=str(tiny_model_dir), **TINY_ENGINE)  # type: ignore[arg-type]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.gpu` tests skip themselves without CUDA (the marker alone skips nothing)."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
