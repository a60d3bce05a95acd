"""Shared fixtures: synthetic byte-level BPE models (trained in-test) and the real SmolLM2 GGUF (fetched on first
use, like every real-model test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer.tokenizer import Tokenizer
from tests.engine.tokenizer.corpus import VARIANTS, train_tokenizer, write_hf_dir

@pytest.fixture(scope="session")
def trained() -> dict[str, HFTokenizer]:
    """One trained HF `tokenizers` model per variant (training takes ~20 ms each)."""
    return {variant: train_tokenizer(variant) for variant in VARIANTS}


@pytest.fixture(scope="session")
def hf_dirs(trained: dict[str, HFTokenizer], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_dirs")
    return {variant: write_hf_dir(model, variant, root / variant) for variant, model in trained.items()}


@pytest.fixture(scope="session")
def smollm_like(hf_dirs: dict[str, Path]) -> Tokenizer:
    """Our tokenizer over the small SmolLM-shaped vocabulary: multi-byte characters span several tokens."""
    return Tokenizer.from_hf_dir(hf_dirs["smollm"])


@pytest.fixture(scope="session")
def smol_gguf(smollm2_gguf: str) -> Path:
    return Path(smollm2_gguf)
