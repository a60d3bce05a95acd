"""The loader's front door: a model argument in, a `Checkpoint` (config, weights, tokenizer) out.

    name or path ──resolve_model──▶ .gguf file ──load_gguf─────────────▶ config, weights ─┐
                                    HF directory ──load_safetensors_dir──▶ config, weights ─┴─▶ Checkpoint
                                    (either) ──Tokenizer.from_gguf / from_hf_dir──▶ tokenizer ──┘
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.loader.errors import ModelLoadError
from engine.loader.gguf_loader import load_gguf, open_gguf
from engine.loader.model_registry import resolve_model
from engine.loader.safetensors_loader import load_safetensors_dir
from engine.model.config import ModelConfig
from engine.model.quantization import Weight

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """Everything a model runner needs from disk.

    `weights` uses HF names and layouts (see `weight_layout`), every tensor in the requested dtype, contiguous,
    on CPU (loaded for `--quantization gguf`: the linear layers' GGUF blocks as `QuantizedWeight`s);
    `lm_head.weight` is absent when `config.tie_word_embeddings`. The dict is the caller's to consume
    (e.g. pop tensors as they move to a device).
    """

    config: ModelConfig
    weights: dict[str, Weight]
    tokenizer: Tokenizer
    path: Path  # the resolved checkpoint: a .gguf file or an HF directory (a name only, for dummy weights)
    # What namespaces its KV block hashes when the engine is given no --model-id; None: a digest of `path`'s files.
    model_id: str | None = None


def load_weights_and_config(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a local checkpoint, choosing the reader by its kind: a directory is an HF checkpoint, a file GGUF."""
    path = Path(path)
    if path.is_dir():
        return load_safetensors_dir(path, dtype)
    if path.is_file():
        return load_gguf(path, dtype)
    raise ModelLoadError(f"{path}: no such checkpoint file or directory")


def load_checkpoint(model: str, dtype: torch.dtype = torch.float32, *, quantization: str = "none") -> Checkpoint:
    """Resolve `model` (a registered name such as "smollm2-135m", a .gguf path or an HF directory), then load
    its config, weights and tokenizer. Errors are those of `resolve_model` and the loaders; `quantization` "gguf"
    keeps a GGUF's linear blocks (engine/loader/gguf_loader.py) and is a ModelLoadError on an HF directory (other
    methods load floats: the engine quantizes them)."""
    path = resolve_model(model)
    if quantization == "gguf" and not path.is_file():
        raise ModelLoadError(f"{path}: --quantization gguf needs a GGUF file (its Q4_0/Q4_1/Q8_0 blocks); this is an "
                             "HF safetensors directory: use --quantization int8 or none")
    # Imported here so the loader works, and is testable, without the tokenizer package.
    from engine.tokenizer.tokenizer import Tokenizer

    if path.is_file():  # a GGUF: its header, parsed once, gives the weights and the tokenizer
        reader = open_gguf(path)
        config, weights = load_gguf(path, dtype, reader=reader, keep_blocks=quantization == "gguf")
        tokenizer = Tokenizer.from_gguf(reader)
    else:
        config, weights = load_weights_and_config(path, dtype)
        tokenizer = Tokenizer.from_hf_dir(str(path))
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, path=path)


def load_engine_checkpoint(config: EngineConfig, device: torch.device | str = "cpu") -> Checkpoint:
    """The checkpoint an engine config names, by its `load_format`: "auto" reads `config.model` from disk (on CPU);
    "dummy" makes seeded random weights of the shape `config.model` names (engine/loader/dummy_weights.py), on
    `device`, seeded by `config.seed` (0 when unset). `config.dtype` must be concrete (engine/device.py)."""
    from engine.device import TORCH_DTYPES

    dtype = TORCH_DTYPES[config.dtype]
    if config.load_format == "dummy":
        from engine.loader import dummy_weights as dummy

        if config.quantization == "gguf":
            raise ModelLoadError("--quantization gguf needs a GGUF file's blocks; --load-format dummy has none "
                                 "(use --quantization int8)")
        model_config = dummy.dummy_model_config(config.model)
        seed = config.seed or 0
        return Checkpoint(
            config=model_config,
            weights=dummy.dummy_weights(model_config, dtype=dtype, device=device, seed=seed),
            tokenizer=dummy.dummy_tokenizer(config.model),
            path=dummy.dummy_checkpoint_path(config.model),
            model_id=dummy.dummy_model_id(config.model, seed),
        )
    if config.quantization == "gguf":  # the one method the loader takes part in (the others quantize floats)
        return load_checkpoint(config.model, dtype=dtype, quantization="gguf")
    return load_checkpoint(config.model, dtype=dtype)
