"""The model's GEMMs: on CPU through oneDNN with each weight packed once at load, else `F.linear`.

torch's CPU `F.linear` goes to MKL's SGEMM; oneDNN picks its kernels by the ISA the CPU reports (its AVX-512
brgemm on our AMD Zen 4 development VMs, where MKL is slower), and a weight reordered once into its blocked layout
saves the per-call packing too. Measured at this model's shapes (bench/onednn_linear.py): 1.1-1.8x at 16-2048 rows,
0.9-2.5x at one row, 1.28x on the whole forward pass. Same math, a different summation order: outputs agree with
MKL's to float32 rounding, not bit for bit (greedy output still matches HF transformers token for token; tests
check it).

A quantized weight (`QuantizedWeight`: --quantization int8, gguf or fp8, engine/model/quantization.py) runs
through `quantized_linear` (engine/kernels/cpu_quantized_linear.py) where its data is on the CPU, and through
`cuda_quantized_linear` (engine/kernels/cuda_quantized_linear.py: Triton kernels, torch._scaled_mm) where it is on
a GPU: read in place, never dequantized to a float matrix.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.kernels.cpu_quantized_linear import quantized_linear
from engine.kernels.cuda_quantized_linear import cuda_quantized_linear
from engine.kernels.quantized_weight import QuantizedWeight
from kv_transfer.native_build import cpu_kernels_disabled

logger = logging.getLogger(__name__)

# Rows the blocked layout is chosen for. Measured flat from 64 to 2048 rows whatever the hint, so one value serves
# prefill-sized and decode-sized steps alike.
_PACK_ROWS_HINT = 256


def onednn_usable(weight: torch.Tensor) -> bool:
    """Whether `weight` can run through packed oneDNN here (CPU, float32/bfloat16, oneDNN built in, no kill switch)."""
    if cpu_kernels_disabled():
        return False
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """y = x @ weight.T + bias, weight [out_features, in_features] as in `torch.nn.Linear`, or a `QuantizedWeight`
    of that logical shape."""

    __slots__ = ("weight", "bias", "packed", "quantized", "on_cuda")

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
                 pack: bool = True) -> None:
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None
        self.on_cuda = False
        if isinstance(weight, QuantizedWeight):
            self.quantized = weight
            self.on_cuda = weight.data.device.type == "cuda"
            self.weight: torch.Tensor | None = None
            return
        if pack and onednn_usable(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)
            except RuntimeError as exc:  # an ISA or build oneDNN turns down: MKL still works
                logger.warning("oneDNN weight packing unavailable (%s); using F.linear", exc)
        # The packed copy replaces the dense one (same bytes). A tied LM head's dense weight lives on as the embedding
        # table, so tying costs one extra vocab x hidden matrix here.
        self.weight = None if self.packed is not None else weight

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out_features, in_features] tensor (unpacked again if packed)."""
        if self.packed is not None:
            return self.packed.to_dense()
        if self.quantized is not None:
            return self.quantized.dequantize()
        assert self.weight is not None
        return self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.quantized is not None:
            y = (cuda_quantized_linear if self.on_cuda else quantized_linear)(x, self.quantized)
            return y if self.bias is None else y.add_(self.bias)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
