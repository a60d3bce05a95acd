"""Dequantization of GGML tensor data to float32, written here rather than borrowed from `gguf.quants`.

A GGML tensor is a run of fixed-size blocks along its innermost (contiguous) dimension; each block packs
`block_size` values into `block_bytes` bytes. The formats, all little-endian (f16 = IEEE half):

    F32   1 value  / 4 bytes    plain
    F16   1 value  / 2 bytes    plain
    BF16  1 value  / 2 bytes    upper half of a float32
    Q8_0  32 / 34   d:f16, q:int8[32]                          x = d * q
    Q4_0  32 / 18   d:f16, nibbles[16]                         x = d * (q - 8)
    Q4_1  32 / 20   d:f16, m:f16, nibbles[16]                  x = d * q + m
    Q5_0  32 / 22   d:f16, qh:u32, nibbles[16]                 x = d * (q - 16)
    Q5_1  32 / 24   d:f16, m:f16, qh:u32, nibbles[16]          x = d * q + m
    Q6_K  256 / 210 ql[128], qh[64], scales:int8[16], d:f16    x = (d * scale) * (q - 32)

In the 32-value formats byte j's low nibble is value j and its high nibble value j + 16; for Q5_* bit i of qh
is the fifth bit of value i. Q6_K is laid out in two halves of 128 values; within half h (ql_h = ql[64h:64h+64],
qh_h = qh[32h:32h+32]) and for l < 32:

    value 128h +      l   low nibble  of ql_h[l]       | bits 0-1 of qh_h[l] << 4
    value 128h + 32 + l   low nibble  of ql_h[32 + l]  | bits 2-3 of qh_h[l] << 4
    value 128h + 64 + l   high nibble of ql_h[l]       | bits 4-5 of qh_h[l] << 4
    value 128h + 96 + l   high nibble of ql_h[32 + l]  | bits 6-7 of qh_h[l] << 4

and value i uses scales[i // 16]. The arithmetic follows ggml's reference order in float32, so the results
match ggml (and `gguf.quants.dequantize`) bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType


# Blocks are decoded a chunk at a time into a preallocated output so that the int intermediates of a large
# embedding (hundreds of millions of values) never all exist at once. The decoders are torch ops, not numpy's:
# the same float32 operations in the same order (so the same bits), ~3x less CPU (a worker's load of SmolLM2 spent
# 1.6 s here with numpy's).
_CHUNK_BLOCKS = 1 << 15

_DecodeBlocks = Callable[[torch.Tensor], torch.Tensor]  # [num_blocks, block_bytes] uint8 -> [num_blocks, block_size]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 stored at byte `start` of each block, as float32 of shape [num_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 16] bytes -> [num_blocks, 32] values: the low nibbles first, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


_BIT_INDEX = torch.arange(32, dtype=torch.int32)


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The 32 one-bit planes of the u32 at byte `start`, shifted to bit 4: [num_blocks, 32] uint8."""
    qh = blocks[:, start : start + 4].contiguous().view(torch.int32)  # [num_blocks, 1]; little-endian, as stored
    return (((qh >> _BIT_INDEX) & 1) << 4).to(torch.uint8)


def _decode_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _decode_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _decode_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # A bfloat16 is the high 16 bits of a float32, so widening is exact, no rounding.
    return blocks.contiguous().view(torch.bfloat16).float()


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8.0)


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return (_f16(blocks, 0) * _nibbles(blocks[:, 4:]).float()).add_(_f16(blocks, 2))


def _decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks, 2)).float() - 16.0
    return _f16(blocks, 0) * q


def _decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks, 4)).float()
    return (_f16(blocks, 0) * q).add_(_f16(blocks, 2))


_Q6_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    num_blocks = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(num_blocks, 2, 64)
    qh = blocks[:, 128:192].reshape(num_blocks, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [num_blocks, 16]
    d = _f16(blocks, 208)  # [num_blocks, 1]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [num_blocks, 2, 128]: the table's four rows in order
    high = ((qh >> _Q6_SHIFTS) & 0x03).reshape(num_blocks, 2, 128)  # row j of a half takes bits 2j..2j+1
    q = (low | (high << 4)).float() - 32.0
    return ((d * scales)[:, :, None] * q.reshape(num_blocks, 16, 16)).reshape(num_blocks, 256)


# type -> (values per block, bytes per block, decoder)
_FORMATS: dict[GGMLQuantizationType, tuple[int, int, _DecodeBlocks]] = {
    GGMLQuantizationType.F32: (1, 4, _decode_f32),
    GGMLQuantizationType.F16: (1, 2, _decode_f16),
    GGMLQuantizationType.BF16: (1, 2, _decode_bf16),
    GGMLQuantizationType.Q8_0: (32, 34, _decode_q8_0),
    GGMLQuantizationType.Q4_0: (32, 18, _decode_q4_0),
    GGMLQuantizationType.Q4_1: (32, 20, _decode_q4_1),
    GGMLQuantizationType.Q5_0: (32, 22, _decode_q5_0),
    GGMLQuantizationType.Q5_1: (32, 24, _decode_q5_1),
    GGMLQuantizationType.Q6_K: (256, 210, _decode_q6_k),
}

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_FORMATS)


def _type_label(ggml_type: GGMLQuantizationType | int) -> str:
    try:
        return f"{GGMLQuantizationType(int(ggml_type)).name} (id {int(ggml_type)})"
    except ValueError:
        return f"<unknown> (id {int(ggml_type)})"


def is_supported(ggml_type: GGMLQuantizationType | int) -> bool:
    return int(ggml_type) in {int(t) for t in _FORMATS}


def unsupported_message(ggml_type: GGMLQuantizationType | int) -> str:
    """'Q2_K (id 10) cannot be dequantized; supported: ...' — shared so every caller names types the same way."""
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    return f"GGML type {_type_label(ggml_type)} cannot be dequantized by splitserve; supported: {supported}"


def packed_size_bytes(ggml_type: GGMLQuantizationType | int, shape: Sequence[int]) -> int:
    """How many bytes a tensor of logical `shape` occupies in `ggml_type`. Raises for unsupported types and
    for shapes whose innermost dimension is not a whole number of blocks."""
    block_size, block_bytes, _ = _format(ggml_type)
    num_values = int(np.prod(shape, dtype=np.int64))
    if len(shape) == 0 or shape[-1] % block_size != 0:
        raise ValueError(
            f"shape {tuple(shape)} does not split into {_type_label(ggml_type)} blocks of {block_size} values"
        )
    return num_values // block_size * block_bytes


class UnsupportedGGMLTypeError(ValueError):
    """A GGML tensor type this module has no decoder for (the loader checks `is_supported` first and raises its own
    `engine.loader.errors.UnsupportedQuantizationError`, naming the tensor)."""


def _format(ggml_type: GGMLQuantizationType | int) -> tuple[int, int, _DecodeBlocks]:
    if not is_supported(ggml_type):
        raise UnsupportedGGMLTypeError(unsupported_message(ggml_type))
    return _FORMATS[GGMLQuantizationType(int(ggml_type))]


def dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: Sequence[int]) -> torch.Tensor:
    """Decode the raw bytes of one GGML tensor into a new float32 tensor of `shape`.

    `shape` is the logical row-major shape (GGUF lists dimensions innermost first; pass them reversed). `data`
    may be any array over the packed bytes (e.g. a read-only memmap view); it is read, never kept. Raises
    `UnsupportedGGMLTypeError` naming the type for formats not listed in the module docstring, and
    `ValueError` when the byte count does not match the shape.
    """
    block_size, block_bytes, decode = _format(ggml_type)
    expected_bytes = packed_size_bytes(ggml_type, shape)
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    if raw.size != expected_bytes:
        raise ValueError(
            f"{_type_label(ggml_type)} tensor of shape {tuple(shape)} needs {expected_bytes} bytes, got {raw.size}"
        )
    blocks = raw.reshape(-1, block_bytes)  # [num_blocks, block_bytes]
    out = torch.empty((blocks.shape[0], block_size), dtype=torch.float32)  # [num_blocks, block_size]
    # Corrupt scales can decode to inf/NaN, silently: loaders refuse non-finite weights with a message naming the
    # tensor (weight_layout.check_weights).
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        chunk = torch.from_numpy(np.array(blocks[start:stop]))  # a copy: `data` may be a read-only memmap
        out[start:stop] = decode(chunk)
    return out.reshape(tuple(int(d) for d in shape))
