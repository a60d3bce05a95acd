"""Load a llama.cpp GGUF checkpoint as a `ModelConfig` plus HF-named, HF-laid-out float weights.

Three translations happen on the way:

- names: `blk.{i}.attn_q.weight` -> `model.layers.{i}.self_attn.q_proj.weight` and so on (`_BLOCK_NAMES`);
- shapes: GGUF lists dimensions innermost first, so a GGUF [in, out] matrix is the row-major [out, in] HF keeps;
- q/k rows: for Llama-family architectures llama.cpp's converter reorders the rows of each head's q and k
  projections so that the two halves of every rotary pair sit side by side (it rotates adjacent pairs; HF
  rotates element i with element i + head_dim/2). `_unpermute_rotary_rows` puts them back. Qwen2 GGUFs are
  converted without the reordering and load as stored.

With `keep_blocks` (`--quantization gguf`), the linear layers' Q4_0 / Q4_1 / Q8_0 tensors are handed over as the
file's blocks (`QuantizedWeight`), not dequantized: a GGUF row is one run of whole blocks, so the q/k row reorder
moves whole rows of bytes. Their F32/F16/BF16 tensors, and every other tensor (embedding, norms), load as floats as
without it; a linear tensor of any other type (e.g. Q6_K) is an `UnsupportedQuantizationError` naming it.

Every failure is a `ModelLoadError` naming the file (see `errors.py`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType, GGUFReader

from engine.kernels import gguf_quants
from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight
from engine.loader.errors import ModelLoadError, UnsupportedQuantizationError
from engine.loader.gguf_metadata import GGUFMetadata, config_from_gguf
from engine.loader.gguf_reader import open_gguf
from engine.loader.weight_layout import check_weights
from engine.model.quantization import Weight, is_linear_weight
from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedArchitectureError

# Architectures whose GGUF q/k rows llama.cpp reorders. llama.cpp writes Llama, Mistral and SmolLM checkpoints
# under "llama"; the other two names are accepted for GGUFs from tools that keep the HF name, and are assumed to
# follow the Llama converter since that is the only one that produces these tensor names for them.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral", "smollm"})
_UNPERMUTED_ARCHITECTURES = frozenset({"qwen2"})
assert _PERMUTED_ARCHITECTURES | _UNPERMUTED_ARCHITECTURES == set(SUPPORTED_ARCHITECTURES)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # consumed by the config (Llama-3 RoPE scaling), not a model weight


def hf_name(gguf_name: str) -> str | None:
    """The HF name for a GGUF tensor name, or None if the model has no such tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order, per head (r = head_dim / 2):

        GGUF row  2i + p   (pair i, member p)      HF row  p*r + i
        GGUF:  x0 y0 x1 y1 ... x(r-1) y(r-1)       HF:  x0 x1 ... x(r-1) y0 y1 ... y(r-1)

    Works for weights [num_heads * head_dim, in] and biases [num_heads * head_dim].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, *, reader: GGUFReader | None = None,
              keep_blocks: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    """Read `path` and return its config and weights (HF names and layouts, `dtype`, contiguous). `reader`: the
    file already opened by `open_gguf` (parsing the header is most of a small model's load: open it once when the
    tokenizer is read from the same file).

    The weights are checked against the config (`weight_layout.check_weights`). Raises `ModelLoadError` for
    unreadable, truncated or inconsistent files, `UnsupportedQuantizationError` for tensor types we cannot
    dequantize (with `keep_blocks`: a linear tensor of a type without a quantized kernel) and
    `UnsupportedArchitectureError` for architectures the engine does not implement. `keep_blocks`: see the module
    docstring; those weights are `QuantizedWeight`s, the rest float tensors.
    """
    path = Path(path)
    if reader is None:
        reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    for tensor in tensors.values():
        if not gguf_quants.is_supported(tensor.tensor_type):
            raise UnsupportedQuantizationError(
                f"{path}: tensor {tensor.name}: {gguf_quants.unsupported_message(tensor.tensor_type)}"
            )

    rope_freqs = None
    if _ROPE_FREQS in tensors:
        rope_freqs = _dequantize(path, tensors[_ROPE_FREQS]).numpy()
    try:
        config = config_from_gguf(GGUFMetadata(reader, path), tensor_names=set(tensors), rope_freqs=rope_freqs)
    except UnsupportedArchitectureError:
        raise  # a ValueError too, but one callers tell apart
    except ValueError as err:  # ModelConfig's own consistency checks
        raise ModelLoadError(f"{path}: inconsistent GGUF metadata: {err}") from err

    permuted = config.architecture in _PERMUTED_ARCHITECTURES
    if permuted and config.head_dim % 2 != 0:
        raise ModelLoadError(f"{path}: odd head size {config.head_dim} cannot carry rotary pairs")
    weights: dict[str, Weight] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name == _ROPE_FREQS:
            continue
        name = hf_name(gguf_name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {gguf_name!r} has no place in a {config.architecture} model")
        if keep_blocks and is_linear_weight(name) and tensor.tensor_type not in _FLOAT_TYPES:
            weights[name] = _blocks(path, tensor, name, config, permuted)
            continue
        weight = _dequantize(path, tensor)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            num_heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            if weight.shape[0] != num_heads * config.head_dim:
                raise ModelLoadError(f"{path}: tensor {gguf_name} has shape {tuple(weight.shape)}, "
                                     f"expected {num_heads * config.head_dim} rows")
            weight = _unpermute_rotary_rows(weight, num_heads)
        weights[name] = weight.to(dtype).contiguous()
    check_weights(weights, config, str(path))
    return config, weights


def _blocks(path: Path, tensor: Any, name: str, config: ModelConfig, permuted: bool) -> QuantizedWeight:
    """A linear tensor's blocks as stored (q/k rows put back in HF order, whole rows at a time)."""
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    try:
        QuantFormat.of_ggml(tensor.tensor_type)
    except ValueError as err:
        raise UnsupportedQuantizationError(f"{path}: tensor {tensor.name} ({name}) is {tensor.tensor_type.name}: "
                                           f"--quantization gguf {err}; load it with --quantization none "
                                           "(dequantized to floats)") from None
    if len(shape) != 2:
        raise ModelLoadError(f"{path}: tensor {tensor.name} has shape {shape}, expected a matrix")
    try:
        weight = QuantizedWeight.from_gguf(tensor.data, tensor.tensor_type, shape)
    except ValueError as err:  # too few bytes, a non-finite block scale: refused at load, never served
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {err}") from err
    if permuted and (".q_proj." in name or ".k_proj." in name):
        num_heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
        if weight.out_features != num_heads * config.head_dim:
            raise ModelLoadError(f"{path}: tensor {tensor.name} has shape {shape}, "
                                 f"expected {num_heads * config.head_dim} rows")
        data = _unpermute_rotary_rows(weight.data, num_heads).contiguous()
        weight = QuantizedWeight(format=weight.format, data=data, in_features=weight.in_features)
    return weight


def _dequantize(path: Path, tensor: Any) -> torch.Tensor:
    shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists the innermost dimension first
    try:
        return gguf_quants.dequantize(tensor.data, tensor.tensor_type, shape)
    except ValueError as err:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {err}") from err
