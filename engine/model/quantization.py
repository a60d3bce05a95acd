"""`--quantization` (vLLM's flag): which linear weights the engine keeps quantized, and how they get that way.

    method   where the quantized weights come from                              runs on
    none     nothing quantized: today's float weights                          any device
    int8     every linear layer's float weight, symmetric per output channel,   cpu (C++), cuda (Triton)
             quantized at load (QuantizedWeight.quantize_int8), any checkpoint
    gguf     a GGUF file's Q4_0 / Q4_1 / Q8_0 linear tensors, kept as the file's  cpu (C++), cuda (Triton)
             blocks (engine/loader/gguf_loader.py hands them over undequantized)
    fp8      every linear layer's float weight in e4m3, one scale per output     cuda, compute capability
             channel, quantized at load (QuantizedWeight.quantize_fp8); e4m3      8.9+ (torch._scaled_mm)
             activations with per-token scales at each call

"Linear layers" are q/k/v (fused into qkv), o, gate/up (fused into gate_up) and down, in every layer: in the
weights dict a quantized one is a `QuantizedWeight` in place of the float tensor, under the same HF name, and the
model's `Linear` runs it through `quantized_linear` (engine/kernels/cpu_quantized_linear.py) on the CPU or
`cuda_quantized_linear` (engine/kernels/cuda_quantized_linear.py) on a GPU, by where its data is (the engine moves
it whole to its device, `QuantizedWeight.to`). The embedding stays float (a lookup, not a GEMM), but for a GGUF
file's tied Q8_0 embedding: its lookups decode rows of the Q8_0 head (`head_holds_embedding`). The LM head, the
largest single matrix of a small model (SmolLM2: 49152 x 576, a fifth of its weights, read whole every decode
step), is quantized by the model when its layers are (`quantize_head`): int8 per row with int8, e4m3 per row with
fp8, Q8_0 with gguf, as llama.cpp runs a GGUF's head (SmolLM2's file stores its tied embedding in Q8_0:
re-quantizing the dequantized values gives back the file's own blocks). At tensor parallelism each rank quantizes
its vocabulary rows: per-row scales and per-row blocks make that the whole head's.

Fusing and tensor-parallel cuts work on whole rows or whole blocks (`cat_rows`, QuantizedWeight.rows/columns), so
a GGUF block is never split: a column-parallel shard is a range of rows, a row-parallel one a range of blocks in
every row (int8 keeps each row's one scale, so a shard computes exactly its part of the whole row's dot product).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence

import torch

from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight

QUANTIZATIONS = ("none", "int8", "gguf", "fp8")
_LINEAR_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})

Weight = torch.Tensor | QuantizedWeight


def is_linear_weight(name: str) -> bool:
    """Whether `name` (an HF weight name) is a linear layer's weight that a quantization method quantizes."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _LINEAR_LEAVES


def check_quantization(method: str, device: torch.device | str) -> None:
    """ValueError, before anything loads, for a method this device does not run (`device` concrete): fp8 off
    cuda or on a GPU older than compute capability 8.9; int8 or gguf on cuda without Triton."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    device = torch.device(device)
    if method == "fp8":
        from engine.kernels.fp8_linear import check_fp8_device

        check_fp8_device(device)
    if method in ("int8", "gguf") and device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"quantization {method} on cuda runs Triton kernels, and triton is not installed")


def quantize_int8(weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """A new dict: every float linear weight (`is_linear_weight`) of `weights` quantized to int8 per output
    channel, the rest as they are (the input is not changed: a checkpoint may be shared by several engines)."""
    return _quantize_linear(weights, QuantizedWeight.quantize_int8)


def quantize_fp8(weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """As `quantize_int8`, to e4m3 per output channel (QuantizedWeight.quantize_fp8), each on its tensor's device."""
    return _quantize_linear(weights, QuantizedWeight.quantize_fp8)


def _quantize_linear(weights: Mapping[str, Weight], quantize: Callable[[torch.Tensor], QuantizedWeight]
                     ) -> dict[str, Weight]:
    out: dict[str, Weight] = {}
    for name, weight in weights.items():
        if is_linear_weight(name) and isinstance(weight, torch.Tensor):
            out[name] = quantize(weight)
        else:
            out[name] = weight
    return out


def weights_on(weights: Mapping[str, Weight], device: torch.device) -> dict[str, Weight]:
    """A new dict with every quantized weight moved whole to `device` (float tensors as they are)."""
    return {name: w.to(device) if isinstance(w, QuantizedWeight) else w for name, w in weights.items()}


def quantize_head(weight: torch.Tensor, like: QuantFormat) -> QuantizedWeight:
    """The LM head's float [vocab, hidden] weight quantized for a model whose layers are in `like`, on the
    weight's device: int8 per row for INT8, e4m3 per row for FP8, Q8_0 (gguf's quantizer, round half away from
    zero as llama.cpp's; on the CPU) for the GGUF formats."""
    if like is QuantFormat.INT8:
        return QuantizedWeight.quantize_int8(weight)
    if like is QuantFormat.FP8:
        return QuantizedWeight.quantize_fp8(weight)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(weight.detach().float().cpu().contiguous().numpy(), GGMLQuantizationType.Q8_0)
    head = QuantizedWeight.from_gguf(blocks, GGMLQuantizationType.Q8_0, tuple(weight.shape))  # type: ignore[arg-type]
    return head.to(weight.device)


def head_holds_embedding(head: Weight, embed: torch.Tensor) -> bool:
    """Whether embedding lookups can read `head` (a tied LM head) instead of the float table `embed`: a Q8_0 head
    on the CPU whose rows decode to exactly `embed`'s float32 values, as a GGUF file's Q8_0 embedding does once
    dequantized at load and re-quantized (`quantize_head`). Anything else keeps the float table: int8 or fp8 rows
    are not the table's values, and the GPU's fused lookup reads a float table."""
    return (isinstance(head, QuantizedWeight) and head.format is QuantFormat.Q8_0 and head.data.device.type == "cpu"
            and embed.device.type == "cpu" and embed.dtype is torch.float32
            and tuple(embed.shape) == (head.out_features, head.in_features) and torch.equal(head.dequantize(), embed))


def holds_quantized(weights: Mapping[str, Weight]) -> bool:
    return any(isinstance(w, QuantizedWeight) for w in weights.values())


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """The weights stacked along their output rows (q/k/v into qkv, gate/up into gate_up): `torch.cat` for float
    tensors; quantized ones must share one format and input size, and their rows (each a run of whole blocks)
    are concatenated as stored."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        raise ValueError("cannot fuse quantized and float weights into one matrix (one tensor of the group is "
                         "stored in a format without a kernel)")
    first = parts[0]
    assert isinstance(first, QuantizedWeight)
    for p in parts:
        assert isinstance(p, QuantizedWeight)
        if p.format is not first.format or p.in_features != first.in_features:
            raise ValueError(f"cannot fuse {p.format.label} [{p.out_features}, {p.in_features}] with "
                             f"{first.format.label} [{first.out_features}, {first.in_features}] row-wise")
    scales = None if first.scales is None else torch.cat([p.scales for p in parts])  # type: ignore[misc]
    return QuantizedWeight(format=first.format, data=torch.cat([p.data for p in parts]),  # type: ignore[union-attr]
                           in_features=first.in_features, scales=scales)


def weight_shape(weight: Weight) -> tuple[int, ...]:
    """The logical shape: a quantized weight's [out_features, in_features]."""
    if isinstance(weight, QuantizedWeight):
        return (weight.out_features, weight.in_features)
    return tuple(weight.shape)


def weight_nbytes(weight: Weight) -> int:
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()
