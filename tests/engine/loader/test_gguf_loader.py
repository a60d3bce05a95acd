"""GGUF loading: round trips through llama.cpp-style files, and refusal of broken ones."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from engine.loader.errors import ModelLoadError, UnsupportedQuantizationError
from engine.loader.gguf_loader import load_gguf
from engine.model.config import UnsupportedArchitectureError
from tests.engine.loader.tiny_checkpoints import TinyModel, build_tiny_model, expected_config_for, write_tiny_gguf


def test_round_trip_matches_hf_state_dict(tiny_model: TinyModel, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_model, tmp_path / f"{tiny_model.variant}.gguf")

    config, weights = load_gguf(path)

    assert config == expected_config_for(tiny_model, tiny_model.variant)
    expected = tiny_model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("matrix_type", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1])
def test_quantized_round_trip_equals_reference_dequantization(
    matrix_type: GGMLQuantizationType, tmp_path: Path
) -> None:
    # Blocks run along rows and the q/k permutation moves whole rows, so undoing it must give exactly the
    # reference dequantization of the unpermuted HF matrix.
    tiny = build_tiny_model("llama_untied_rope3")
    _, weights = load_gguf(write_tiny_gguf(tiny, tmp_path / "q.gguf", matrix_type))

    for name, tensor in tiny.state_dict().items():
        data = tensor.numpy()
        if data.ndim == 2:
            data = gguf.quants.dequantize(gguf.quants.quantize(data, matrix_type), matrix_type)
        assert torch.equal(weights[name], torch.from_numpy(data)), name


def test_dtype_cast_and_contiguity(tmp_path: Path) -> None:
    tiny = build_tiny_model("qwen2_bias")
    _, weights = load_gguf(write_tiny_gguf(tiny, tmp_path / "bf16.gguf"), dtype=torch.bfloat16)

    for name, tensor in tiny.state_dict().items():
        assert weights[name].dtype == torch.bfloat16 and weights[name].is_contiguous()
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def _assert_load_error(path: Path, *fragments: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_gguf(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message
    return info.value


@pytest.mark.parametrize("keep_fraction", [0.0001, 0.01, 0.5, 0.999])
def test_truncated_file_is_refused(llama_gguf: Path, tmp_path: Path, keep_fraction: float) -> None:
    data = llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(4, int(len(data) * keep_fraction))])

    _assert_load_error(cut, "truncated")


@pytest.mark.parametrize("content", [b"", b"GGU", b"PK\x03\x04not a gguf at all"])
def test_non_gguf_file_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)

    _assert_load_error(path, "not a GGUF file")


def _tensor_type_offset(data: bytes, tensor_name: str) -> int:
    # Tensor info: name (u64 length + bytes), n_dims u32, dims u64[n_dims], type u32, offset u64.
    name = tensor_name.encode()
    start = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, start)
    return start + 4 + 8 * n_dims


def test_corrupt_tensor_type_is_refused(llama_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(llama_gguf.read_bytes())
    struct.pack_into("<I", data, _tensor_type_offset(bytes(data), "token_embd.weight"), 99)
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))

    _assert_load_error(bad, "corrupt")


def test_corrupt_dimension_is_refused(llama_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(llama_gguf.read_bytes())
    dims_offset = _tensor_type_offset(bytes(data), "output_norm.weight") - 8  # its only dimension
    struct.pack_into("<Q", data, dims_offset, 1 << 40)
    bad = tmp_path / "baddim.gguf"
    bad.write_bytes(bytes(data))

    _assert_load_error(bad)


def _write_minimal(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]],
                   **metadata: int) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_uint32(key.replace("__", "."), value)
    for name, (data, raw_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_quantization_names_type_tensor_and_file(tmp_path: Path) -> None:
    q2k_bytes = np.zeros((2, 84), dtype=np.uint8)  # two rows of one 256-value Q2_K block
    path = _write_minimal(tmp_path / "q2k.gguf", "llama", {"token_embd.weight": (q2k_bytes, GGMLQuantizationType.Q2_K)})

    with pytest.raises(UnsupportedQuantizationError) as info:
        load_gguf(path)
    assert str(path) in str(info.value) and "Q2_K" in str(info.value) and "token_embd.weight" in str(info.value)


def test_missing_metadata_key_is_named(tmp_path: Path) -> None:
    path = _write_minimal(tmp_path / "nokeys.gguf", "llama", {"output_norm.weight": (np.ones(8, np.float32), None)},
                          llama__attention__head_count=2)

    _assert_load_error(path, "llama.embedding_length")


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = _write_minimal(tmp_path / "gpt2.gguf", "gpt2", {"output_norm.weight": (np.ones(8, np.float32), None)})

    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'"):
        load_gguf(path)


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    extra = {"blk.0.attn_qkv.weight": np.zeros((192, 64), np.float32)}  # a fused layout this engine lacks
    path = write_tiny_gguf(build_tiny_model("llama_tied"), tmp_path / "fused.gguf", extra_tensors=extra)

    _assert_load_error(path, "blk.0.attn_qkv.weight")


def test_metadata_inconsistent_with_tensors_is_refused(tmp_path: Path) -> None:
    tiny = build_tiny_model("llama_tied")
    tiny.model.config.intermediate_size = 96  # the metadata now disagrees with every ffn tensor
    path = write_tiny_gguf(tiny, tmp_path / "liar.gguf")

    _assert_load_error(path, "mlp.")


def test_non_finite_weight_is_refused(tmp_path: Path) -> None:
    tiny = build_tiny_model("llama_tied")
    with torch.no_grad():
        tiny.model.model.norm.weight[3] = float("nan")  # what a damaged scale usually decodes to
    path = write_tiny_gguf(tiny, tmp_path / "nan.gguf")

    _assert_load_error(path, "model.norm.weight", "NaN")


def _stock_and_ours(path: Path) -> tuple[gguf.GGUFReader, gguf.GGUFReader]:
    from engine.loader.gguf_loader import open_gguf

    return gguf.GGUFReader(path), open_gguf(path)


def test_header_parse_equals_the_stock_readers_for_every_array_kind(tmp_path: Path) -> None:
    """open_gguf reads arrays of strings and scalars in one loop instead of gguf's per-element recursion: every
    field (parts' bytes and dtypes, data indices, types, contents) must be what the stock GGUFReader gives."""
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("t.strings", ["", "a", "Ġthe", "日本", "x" * 300])
    writer.add_array("t.empty", [])
    writer.add_array("t.int32", [3, -1, 7])
    writer.add_array("t.float32", [0.5, -2.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])  # arrays of arrays: left to the stock reader
    writer.add_string("t.string", "plain")
    writer.add_uint32("t.u32", 9)
    writer.add_tensor("w", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    stock, ours = _stock_and_ours(path)
    assert ours.fields.keys() == stock.fields.keys()
    for name, expected in stock.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.data, got.types) == (expected.offset, expected.data, expected.types), name
        assert [(p.dtype, p.tobytes()) for p in got.parts] == [(p.dtype, p.tobytes()) for p in expected.parts], name
        assert got.contents() == expected.contents(), name
    assert ours.fields["t.strings"].contents() == ["", "a", "Ġthe", "日本", "x" * 300]
    assert [t.name for t in ours.tensors] == ["w"]


@pytest.mark.parametrize("cut_into", ["a string's length", "a string's bytes"])
def test_a_string_array_cut_short_is_refused_as_truncated(tmp_path: Path, cut_into: str) -> None:
    path = tmp_path / "strings.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("t.strings", ["first", "second-string"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = path.read_bytes()
    last = data.rindex(b"second-string")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: last - 4] if cut_into == "a string's length" else data[: last + 3])
    _assert_load_error(cut, "truncated")
