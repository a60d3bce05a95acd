"""Translate a GGUF file's key/value metadata into a `ModelConfig`.

Keys are those llama.cpp's converter writes, `{arch}.*` with arch = `general.architecture`. A missing required
key, or one of the wrong type, is a `ModelLoadError` naming the key and the file. A few facts are not in the
metadata and come from the tensor list: tied embeddings (no `output.weight`), q/k/v biases
(`blk.0.attn_q.bias`) and Llama-3 RoPE scaling (a `rope_freqs.weight` tensor of per-frequency divisors).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from engine.loader.errors import ModelLoadError
from engine.loader.rope_scaling import DEFAULT_ORIGINAL_CONTEXT, infer_llama3_scaling
from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedArchitectureError

_DEFAULT_ROPE_THETA = 10000.0  # llama.cpp's own default when the key is absent


class GGUFMetadata:
    """Typed access to one reader's key/value fields; every failure names the file and the key."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._reader = reader
        self.path = path

    def _value(self, key: str) -> Any:
        field = self._reader.get_field(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as err:  # the reader parsed the bytes; decoding them can still fail on a corrupt file
            raise ModelLoadError(f"{self.path}: metadata key {key!r} cannot be decoded ({err})") from err

    def _typed(self, key: str, convert: Callable[[Any], Any], kind: str, required: bool = False) -> Any:
        value = self._value(key)
        if value is None:
            if required:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks the required key {key!r}")
            return None
        if isinstance(value, (list, bytes)) or isinstance(value, str) != (kind == "a string"):
            raise ModelLoadError(f"{self.path}: metadata key {key!r} should be {kind}, got {value!r:.80}")
        return convert(value)

    def get_int(self, key: str) -> int | None:
        return self._typed(key, int, "an integer")

    def require_int(self, key: str) -> int:
        return self._typed(key, int, "an integer", required=True)

    def get_float(self, key: str) -> float | None:
        return self._typed(key, _float32_to_float, "a number")

    def require_float(self, key: str) -> float:
        return self._typed(key, _float32_to_float, "a number", required=True)

    def get_str(self, key: str) -> str | None:
        return self._typed(key, str, "a string")

    def require_str(self, key: str) -> str:
        return self._typed(key, str, "a string", required=True)

    def array_length(self, key: str) -> int | None:
        field = self._reader.get_field(key)
        return None if field is None else len(field.data)


def _float32_to_float(value: Any) -> float:
    # GGUF floats are usually float32; for those, the shortest decimal that rounds to the stored value gives
    # back what the original config said (1e-05, not 9.999999747378752e-06). A float64 is taken as it is.
    value = float(value)
    return float(str(np.float32(value))) if float(np.float32(value)) == value else value


def architecture_of(meta: GGUFMetadata) -> str:
    """`general.architecture`, refused by name unless the engine implements it."""
    arch = meta.require_str("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(arch)
    return arch


def config_from_gguf(
    meta: GGUFMetadata,
    *,
    tensor_names: set[str],
    rope_freqs: np.ndarray | None,
) -> ModelConfig:
    """Build the `ModelConfig`. `rope_freqs` is the dequantized `rope_freqs.weight` tensor, if the file has one."""
    arch = architecture_of(meta)
    num_heads = meta.require_int(f"{arch}.attention.head_count")
    hidden_size = meta.require_int(f"{arch}.embedding_length")
    num_kv_heads = meta.get_int(f"{arch}.attention.head_count_kv") or num_heads
    if num_heads <= 0 or hidden_size <= 0 or num_kv_heads <= 0:
        raise ModelLoadError(f"{meta.path}: non-positive head count or embedding length in the metadata")
    # key_length is the head size when it differs from hidden/heads; rope.dimension_count is the rotary size.
    head_dim = meta.get_int(f"{arch}.attention.key_length") or hidden_size // num_heads
    rotary_dim = meta.get_int(f"{arch}.rope.dimension_count") or head_dim
    if rotary_dim != head_dim:
        raise ModelLoadError(
            f"{meta.path}: partial rotary embeddings (rope.dimension_count {rotary_dim} != head size {head_dim}) "
            "are not supported"
        )
    rope_theta = meta.get_float(f"{arch}.rope.freq_base") or _DEFAULT_ROPE_THETA

    vocab_size = meta.array_length("tokenizer.ggml.tokens") or meta.get_int(f"{arch}.vocab_size")
    if not vocab_size:
        raise ModelLoadError(f"{meta.path}: no vocabulary size (neither tokenizer.ggml.tokens nor {arch}.vocab_size)")

    rope_type = meta.get_str(f"{arch}.rope.scaling.type")
    if rope_type not in (None, "none"):
        raise ModelLoadError(f"{meta.path}: RoPE scaling type {rope_type!r} is not supported (only Llama-3 style)")
    rope_scaling = None
    if rope_freqs is not None:
        original = meta.get_int(f"{arch}.rope.scaling.original_context_length") or DEFAULT_ORIGINAL_CONTEXT
        try:
            rope_scaling = infer_llama3_scaling(rope_freqs, rope_theta, rotary_dim, original)
        except ValueError as err:
            raise ModelLoadError(f"{meta.path}: rope_freqs.weight: {err}") from err

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):  # every id that ends a turn stops generation
        token_id = meta.get_int(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)

    return ModelConfig(
        architecture=arch,
        # The file name, not general.name: two quantizations of one model share a general.name but not their
        # KV caches, and the name namespaces block hashes.
        name=meta.path.stem,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta.require_int(f"{arch}.feed_forward_length"),
        num_layers=meta.require_int(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.require_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=rope_theta,
        max_position_embeddings=meta.require_int(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        bos_token_id=meta.get_int("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos_ids),
    )
