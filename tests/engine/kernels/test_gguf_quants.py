"""Our dequantizers against gguf's reference implementation, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from engine.kernels.gguf_quants import UnsupportedGGMLTypeError, SUPPORTED_TYPES, dequantize, packed_size_bytes

# Values spanning several magnitudes, with exact zeros and a constant row: the cases where scale choices differ.
SHAPE = (6, 512)


def _sample() -> np.ndarray:
    rng = np.random.default_rng(1234)
    data = rng.standard_normal(SHAPE).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 3, (SHAPE[0], 1))
    data[1, :40] = 0.0
    data[2] = 0.5
    return data.astype(np.float32)


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_matches_reference_on_quantized_data(ggml_type: T) -> None:
    packed = reference_quantize(_sample(), ggml_type)

    ours = dequantize(packed, ggml_type, SHAPE)

    assert ours.dtype == torch.float32 and tuple(ours.shape) == SHAPE
    expected = reference_dequantize(packed, ggml_type).astype(np.float32)
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_q6_k_matches_reference_on_random_blocks() -> None:
    # gguf cannot quantize to Q6_K, so decode random blocks whose f16 scale (the last 2 bytes) is finite.
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(SHAPE[0] * SHAPE[1] // 256, 210), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
    blocks[:, 208:210] = scales.view(np.uint8).reshape(-1, 2)
    packed = blocks.reshape(SHAPE[0], -1)

    ours = dequantize(packed, T.Q6_K, SHAPE)

    np.testing.assert_array_equal(ours.numpy(), reference_dequantize(packed, T.Q6_K))


def test_accepts_flat_bytes_and_3d_shapes() -> None:
    packed = reference_quantize(_sample(), T.Q8_0)

    ours = dequantize(packed.reshape(-1), T.Q8_0, (2, 3, 512))

    np.testing.assert_array_equal(ours.numpy().reshape(SHAPE), reference_dequantize(packed, T.Q8_0))


@pytest.mark.parametrize("ggml_type", [T.Q2_K, T.IQ4_NL, 77])
def test_unsupported_type_is_named(ggml_type: T | int) -> None:
    with pytest.raises(UnsupportedGGMLTypeError) as info:
        dequantize(np.zeros(1024, np.uint8), ggml_type, (1, 256))
    label = ggml_type.name if isinstance(ggml_type, T) else "id 77"
    assert label in str(info.value)


def test_wrong_byte_count_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 68 bytes, got 67"):
        dequantize(np.zeros(67, np.uint8), T.Q8_0, (1, 64))


def test_partial_block_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="blocks of 32"):
        packed_size_bytes(T.Q4_0, (4, 48))


def test_supported_types_cover_the_required_set() -> None:
    assert {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1} <= set(SUPPORTED_TYPES)
