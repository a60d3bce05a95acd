"""A quantized linear weight as it sits in memory (GGUF's own blocks, or int8 per output channel), and the torch
expressions the CPU kernels (engine/kernels/cpu_quantized_linear.py) are held to.

    format   data (one row per output feature, contiguous)                 scales            W[o, i] =
    Q4_0     uint8 [out, in/32 * 18]  d:f16, nibbles[16]  per 32 inputs    (in the blocks)   d * (q - 8)
    Q4_1     uint8 [out, in/32 * 20]  d:f16, m:f16, nibbles[16]            (in the blocks)   d * q + m
    Q8_0     uint8 [out, in/32 * 34]  d:f16, q:int8[32]                    (in the blocks)   d * q
    INT8     int8  [out, in]                                               float32 [out]     scale[o] * q
    FP8      float8_e4m3fn [out, in]                                       float32 [out]     scale[o] * q
                                                                            (cuda only: fp8_linear.py)

The GGUF formats keep the file's bytes as they are stored (engine/kernels/gguf_quants.py describes each block):
a GGUF matrix is row-major with its blocks along the input dimension, so output row o is one contiguous run of
in/32 blocks. A tensor-parallel shard is therefore a range of whole rows (`rows`, column-parallel layers) or a
range of whole blocks in every row (`columns`, row-parallel layers): a block is never split.

The data lives on the CPU, or on a GPU for the cuda kernels (engine/kernels/cuda_quantized_linear.py; `to`
moves a weight there whole).

A weight is checked when it is made: shapes, dtypes, and every scale (and Q4_1 minimum) finite, so a corrupt block
is refused at load, never served.

Two torch expressions per weight, used by the tests and as the fallback where the C++ module cannot build:

    quantized_linear_reference(x, w)   x @ dequantize(w).T, float32, with gguf_quants' bit-exact decoders:
                                       what the float32 engine computes on the same weights today
    quantized_linear_torch(x, w)       what the kernel computes, in torch. For GGUF formats the activations are
                                       first quantized to Q8 per block of 32 (as llama.cpp does, so that the
                                       kernel's dot products are integer ones): x̂ = q8(x), y = x̂ @ dequantize(w).T.
                                       For INT8 the activations stay float: y = (x @ q.T) * scale.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from engine.kernels import gguf_quants

Q8_BLOCK = 32  # values per Q8 activation block (and per GGUF block of every format here)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


class QuantFormat(enum.Enum):
    """A weight format the CPU kernels run. `code` is the number the C++ side knows it by."""

    Q4_0 = ("q4_0", 0, 18, GGMLQuantizationType.Q4_0)
    Q4_1 = ("q4_1", 1, 20, GGMLQuantizationType.Q4_1)
    Q8_0 = ("q8_0", 2, 34, GGMLQuantizationType.Q8_0)
    INT8 = ("int8", 3, 1, None)
    FP8 = ("fp8", 4, 1, None)  # no C++ kernel: cuda only (torch._scaled_mm)

    def __init__(self, label: str, code: int, block_bytes: int, ggml_type: GGMLQuantizationType | None) -> None:
        self.label = label
        self.code = code
        self.block_bytes = block_bytes  # bytes of one block (INT8: one value)
        self.ggml_type = ggml_type

    @property
    def block_size(self) -> int:
        """Input values per block: the granularity of `in_features` and of a column shard."""
        return 1 if self.per_channel else Q8_BLOCK

    @property
    def per_channel(self) -> bool:
        """Values in `data`, one float32 scale per output row in `scales` (INT8, FP8); else GGUF blocks."""
        return self in (QuantFormat.INT8, QuantFormat.FP8)

    @property
    def is_gguf(self) -> bool:
        return self.ggml_type is not None

    @staticmethod
    def of_ggml(ggml_type: GGMLQuantizationType | int) -> QuantFormat:
        for fmt in QuantFormat:
            if fmt.ggml_type is not None and int(fmt.ggml_type) == int(ggml_type):
                return fmt
        try:
            name = GGMLQuantizationType(int(ggml_type)).name
        except ValueError:
            name = "<unknown>"
        known = ", ".join(f.label.upper() for f in QuantFormat if f.is_gguf)
        raise ValueError(f"no quantized CPU kernel for GGML type {name} (id {int(ggml_type)}); they run {known}")


_DATA_DTYPES = {QuantFormat.Q4_0: torch.uint8, QuantFormat.Q4_1: torch.uint8, QuantFormat.Q8_0: torch.uint8,
                QuantFormat.INT8: torch.int8, QuantFormat.FP8: torch.float8_e4m3fn}


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [out_features, in_features] weight in `format` (see the module docstring for `data` and `scales`)."""

    format: QuantFormat
    data: torch.Tensor
    in_features: int
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        fmt, data = self.format, self.data
        want_dtype = _DATA_DTYPES[fmt]
        if (data.dim() != 2 or data.dtype != want_dtype or data.device.type not in ("cpu", "cuda")
                or not data.is_contiguous()):
            raise ValueError(f"{fmt.label} weight data must be a contiguous CPU or CUDA {want_dtype} matrix "
                             f"[out_features, bytes per row], got {data.dtype} {tuple(data.shape)} on {data.device}")
        if self.in_features <= 0 or self.in_features % fmt.block_size:
            raise ValueError(f"{fmt.label}: in_features {self.in_features} is not a positive multiple of "
                             f"{fmt.block_size}")
        row_bytes = self.in_features // fmt.block_size * fmt.block_bytes
        if data.shape[1] != row_bytes:
            raise ValueError(f"{fmt.label}: {self.in_features} inputs take {row_bytes} bytes a row, the data has "
                             f"{data.shape[1]}")
        if fmt.per_channel:
            s = self.scales
            if (s is None or s.dtype != torch.float32 or s.shape != (data.shape[0],) or not s.is_contiguous()
                    or s.device != data.device):
                raise ValueError(f"{fmt.label} weight needs float32 scales of shape ({data.shape[0]},) on "
                                 f"{data.device}, got {None if s is None else (s.dtype, tuple(s.shape), s.device)}")
            bad = (~torch.isfinite(s)).nonzero()
            if len(bad):
                raise ValueError(f"{fmt.label} weight: scale of output row {int(bad[0])} is {float(s[bad[0]])}")
        else:
            if self.scales is not None:
                raise ValueError(f"{fmt.label} keeps its scales in its blocks; scales must be None")
            self._check_block_scales()

    def _check_block_scales(self) -> None:
        blocks = self.data.view(self.out_features, -1, self.format.block_bytes)  # [out, num_blocks, block_bytes]
        fields = [("scale", 0)] + ([("minimum", 2)] if self.format is QuantFormat.Q4_1 else [])
        for what, start in fields:
            values = blocks[:, :, start : start + 2].contiguous().view(torch.float16)  # [out, num_blocks, 1]
            bad = (~torch.isfinite(values)).nonzero()
            if len(bad):
                row, block = int(bad[0, 0]), int(bad[0, 1])
                raise ValueError(f"{self.format.label} weight: block {block} of output row {row} has a non-finite "
                                 f"{what} ({float(values[row, block, 0])})")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        """Resident bytes: the blocks (or int8 values) and any separate scales."""
        scale_bytes = 0 if self.scales is None else self.scales.numel() * 4
        return self.data.numel() * self.data.element_size() + scale_bytes

    # -- making one ------------------------------------------------------------------------------------------
    @staticmethod
    def from_gguf(raw: np.ndarray | torch.Tensor, ggml_type: GGMLQuantizationType | int,
                  shape: tuple[int, int]) -> QuantizedWeight:
        """A GGUF tensor's bytes, kept as stored (a copy if `raw` is read-only, e.g. a memmap). `shape` is the
        logical [out_features, in_features] (GGUF lists dimensions innermost first: pass them reversed)."""
        fmt = QuantFormat.of_ggml(ggml_type)
        out_features, in_features = (int(d) for d in shape)
        expected = gguf_quants.packed_size_bytes(ggml_type, (out_features, in_features))
        flat = raw.reshape(-1) if isinstance(raw, torch.Tensor) else torch.from_numpy(
            np.array(np.asarray(raw).reshape(-1).view(np.uint8)))
        if flat.dtype != torch.uint8 or flat.numel() != expected:
            raise ValueError(f"{fmt.label} tensor of shape {tuple(shape)} needs {expected} bytes, got "
                             f"{flat.numel() * flat.element_size()}")
        return QuantizedWeight(format=fmt, data=flat.contiguous().view(out_features, -1), in_features=in_features)

    @staticmethod
    def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
        """Symmetric int8 per output channel: scale[o] = max|W[o]| / 127, q = round(W / scale) in [-127, 127]
        (an all-zero row stores scale 1: it dequantizes to zeros all the same)."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"int8 quantization needs a floating-point matrix, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        w = weight.detach().float()
        if not bool(torch.isfinite(w).all()):
            raise ValueError("int8 quantization: the weight has non-finite values")
        amax = w.abs().amax(dim=1)  # [out]
        scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(format=QuantFormat.INT8, data=q.contiguous(), in_features=w.shape[1],
                               scales=scales.contiguous())

    @staticmethod
    def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
        """e4m3 per output channel: scale[o] = max|W[o]| / 448, q = e4m3(W / scale) (round to nearest even, the
        cast's; |W / scale| <= 448 so nothing saturates). An all-zero row stores scale 1. On W's device."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"fp8 quantization needs a floating-point matrix, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        w = weight.detach().float()
        if not bool(torch.isfinite(w).all()):
            raise ValueError("fp8 quantization: the weight has non-finite values")
        amax = w.abs().amax(dim=1)  # [out]
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedWeight(format=QuantFormat.FP8, data=q.contiguous(), in_features=w.shape[1],
                               scales=scales.contiguous())

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its data (and scales) on `device`; itself when already there."""
        device = torch.device(device)
        if self.data.device == device or (device.index is None and self.data.device.type == device.type):
            return self
        scales = None if self.scales is None else self.scales.to(device)
        return QuantizedWeight(format=self.format, data=self.data.to(device), in_features=self.in_features,
                               scales=scales)

    # -- shards: whole rows or whole blocks --------------------------------------------------------------------
    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows [start, stop): a column-parallel shard (a view, no copy)."""
        if not 0 <= start < stop <= self.out_features:
            raise ValueError(f"row range [{start}, {stop}) outside [0, {self.out_features})")
        scales = None if self.scales is None else self.scales[start:stop]
        return QuantizedWeight(format=self.format, data=self.data[start:stop], in_features=self.in_features,
                               scales=scales)

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input columns [start, stop), both multiples of the block size: a row-parallel shard (a copy)."""
        size = self.format.block_size
        if not 0 <= start < stop <= self.in_features or start % size or stop % size:
            raise ValueError(f"{self.format.label}: column range [{start}, {stop}) must lie in "
                             f"[0, {self.in_features}) on {size}-value block boundaries")
        bb = self.format.block_bytes
        data = self.data[:, start // size * bb : stop // size * bb].contiguous()
        return QuantizedWeight(format=self.format, data=data, in_features=stop - start, scales=self.scales)

    # -- float -------------------------------------------------------------------------------------------------
    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([T] int64) as float32 [T, in_features], the same values `dequantize()[ids]` holds: an
        embedding lookup from a quantized table, without the float table. Q8_0 in torch (d · q, the decoder's
        float32 product), the other formats through `dequantize` of the selected rows."""
        picked = QuantizedWeight(format=self.format, data=self.data.index_select(0, ids), in_features=self.in_features,
                                 scales=None if self.scales is None else self.scales.index_select(0, ids))
        if self.format is not QuantFormat.Q8_0:
            return picked.dequantize()
        blocks = picked.data.view(len(ids), -1, self.format.block_bytes)  # [T, num_blocks, 34]
        d = blocks[:, :, :2].contiguous().view(torch.float16).float()  # [T, num_blocks, 1]
        q = blocks[:, :, 2:].contiguous().view(torch.int8).float()  # [T, num_blocks, 32]
        return (d * q).view(len(ids), self.in_features)

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] float32 on the data's device: gguf_quants' bit-exact decoders (GGUF),
        q * scale (INT8, FP8)."""
        if self.format.per_channel:
            assert self.scales is not None
            return self.data.float() * self.scales[:, None]
        assert self.format.ggml_type is not None
        dense = gguf_quants.dequantize(self.data.cpu().numpy(), self.format.ggml_type,
                                       (self.out_features, self.in_features))
        return dense.to(self.data.device)


# -- the torch expressions ---------------------------------------------------------------------------------------
def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8 per block of 32 along the last dim, as ggml's quantize_row_q8_0 (rounding half to even):

        d = max|x_block| / 127,   q = round(x * (1/d)) in [-127, 127]   (d = 0: q = 0)

    x: [tokens, in] float32 -> (q int8 [tokens, in], d float32 [tokens, in / 32]). The C++ kernel computes the
    same bits. A value's error is at most d / 2, half a step of its block."""
    tokens, in_features = x.shape
    blocks = x.reshape(tokens, in_features // Q8_BLOCK, Q8_BLOCK)
    d = blocks.abs().amax(dim=-1) / 127  # [tokens, num_blocks]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.reshape(tokens, in_features), d


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 per token, fp8_linear's activations: s = max(max|x[t]|, 1e-12) / 448, x̂ = e4m3(x / s) (round to
    nearest even; |x / s| <= 448). x [T, K] -> (x̂ float8_e4m3fn [T, K], s float32 [T, 1]). The Triton kernel
    (triton/fp8_quantize.py) computes the same bits on a GPU."""
    xf = x.float()
    # Divided by a tensor on x's device, not by the Python number: on cuda torch turns a division by a host scalar
    # into a multiplication by its reciprocal, one bit off the IEEE quotient (and the Triton kernel's) now and then.
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / xf.new_full((), FP8_MAX)  # [T, 1]
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_activations_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    tokens, in_features = q.shape
    return (q.reshape(tokens, -1, Q8_BLOCK).float() * d[..., None]).reshape(tokens, in_features)


def quantized_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ dequantize(weight).T in float32: [tokens, in] -> [tokens, out]."""
    return x.float() @ weight.dequantize().T


def quantized_linear_torch(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's contract in torch (float32 out): GGUF formats q8(x) @ dequantize(w).T, INT8 (x @ q.T) * scale.
    It dequantizes the whole weight on every call: a fallback, not a fast path."""
    x = x.float()
    if weight.format is QuantFormat.FP8:
        raise ValueError("fp8 weights run on cuda only (engine/kernels/fp8_linear.py)")
    if weight.format is QuantFormat.INT8:
        assert weight.scales is not None
        return F.linear(x, weight.data.float()) * weight.scales
    return dequantize_activations_q8(*quantize_activations_q8(x)) @ weight.dequantize().T


def linear_output(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The uninitialised [M, N] output, in x's dtype on x's device, of a quantized GEMM kernel x [M, K] @ W.T, after
    checking what every such kernel takes: x 2-D with contiguous rows, float32 / bfloat16 / float16, K inputs, on the
    weight's device."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x: [M, K] with contiguous rows, got {tuple(x.shape)}"
    assert x.shape[1] == weight.in_features, f"x has {x.shape[1]} inputs, the weight {weight.in_features}"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"unsupported dtype {x.dtype}"
    assert x.device == weight.data.device, f"x on {x.device}, the weight on {weight.data.device}"
    return torch.empty(x.shape[0], weight.out_features, dtype=x.dtype, device=x.device)
