"""The front door: dispatch by checkpoint kind, and the tokenizer hand-off (with a stand-in tokenizer)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import gguf
import pytest
import torch

from engine.loader.checkpoint import load_checkpoint, load_weights_and_config
from engine.loader.errors import ModelLoadError
from tests.engine.loader.tiny_checkpoints import build_tiny_model, write_tiny_gguf


class _FakeTokenizer:
    def __init__(self, source: str, path: str) -> None:
        self.source, self.path = source, path

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> _FakeTokenizer:
        # load_checkpoint hands over the reader it opened for the weights: the header is parsed once
        assert isinstance(reader, gguf.GGUFReader)
        return cls("gguf", str(reader.data.filename))

    @classmethod
    def from_hf_dir(cls, path: str) -> _FakeTokenizer:
        return cls("hf", path)


@pytest.fixture
def fake_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("engine.tokenizer.tokenizer")
    module.Tokenizer = _FakeTokenizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engine.tokenizer.tokenizer", module)


def test_gguf_and_hf_dir_load_the_same_weights(tmp_path: Path) -> None:
    tiny = build_tiny_model("qwen2_bias")
    gguf_path = write_tiny_gguf(tiny, tmp_path / "qwen.gguf")
    tiny.model.save_pretrained(tmp_path / "qwen")

    gguf_config, gguf_weights = load_weights_and_config(gguf_path, torch.bfloat16)
    hf_config, hf_weights = load_weights_and_config(tmp_path / "qwen", torch.bfloat16)

    assert gguf_config == hf_config  # same name too: the file stem and the directory name are both "qwen"
    assert gguf_weights.keys() == hf_weights.keys()
    assert all(torch.equal(gguf_weights[k], hf_weights[k]) for k in hf_weights)


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such checkpoint"):
        load_weights_and_config(tmp_path / "nothing.gguf")


@pytest.mark.usefixtures("fake_tokenizer")
def test_load_checkpoint_pairs_weights_with_the_matching_tokenizer(tmp_path: Path) -> None:
    tiny = build_tiny_model("llama_tied")
    gguf_path = write_tiny_gguf(tiny, tmp_path / "tiny.gguf")
    tiny.model.save_pretrained(tmp_path / "tiny")

    from_gguf = load_checkpoint(str(gguf_path))
    from_dir = load_checkpoint(str(tmp_path / "tiny"), dtype=torch.float16)

    assert (from_gguf.tokenizer.source, from_gguf.tokenizer.path) == ("gguf", str(gguf_path))
    assert (from_dir.tokenizer.source, from_dir.tokenizer.path) == ("hf", str(tmp_path / "tiny"))
    assert from_gguf.config.num_layers == 2 and from_dir.path == tmp_path / "tiny"
    assert from_dir.weights["model.norm.weight"].dtype == torch.float16
