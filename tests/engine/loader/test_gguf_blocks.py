"""`--quantization gguf` at load: a GGUF's Q4_0/Q4_1/Q8_0 linear tensors handed over as the file's blocks, in HF row
order, equal bit for bit (dequantized) to what the float loader produces from the same file; the q/k/v and gate/up
fusion and the tensor-parallel cuts move whole rows / whole blocks; anything else is one error naming the tensor.

Over the tiny llama GGUF written as llama.cpp's converter writes it (q/k rows permuted: a block loader that forgot to
undo the permutation on the blocks fails here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from engine.distributed.sharding import shard_weights, tp_shape
from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight
from engine.loader.checkpoint import load_checkpoint
from engine.loader.errors import ModelLoadError, UnsupportedQuantizationError
from engine.loader.gguf_loader import load_gguf
from engine.model.quantization import cat_rows, is_linear_weight
from tests.engine.loader.tiny_checkpoints import build_tiny_model, write_tiny_gguf

BLOCK_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.fixture(scope="module")
def tiny_llama():
    return build_tiny_model("llama_tied")


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_to_the_float_loaders_weights(tiny_llama, tmp_path: Path, ggml_type) -> None:
    path = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", ggml_type)
    config, floats = load_gguf(path)
    _, blocks = load_gguf(path, keep_blocks=True)
    assert blocks.keys() == floats.keys()
    linear = [name for name in blocks if is_linear_weight(name)]
    assert len(linear) == 7 * config.num_layers
    for name, weight in blocks.items():
        if name in linear:
            assert isinstance(weight, QuantizedWeight) and weight.format is QuantFormat.of_ggml(ggml_type), name
            assert torch.equal(weight.dequantize(), floats[name]), name  # HF row order, bit for bit
        else:  # the embedding (a lookup, the tied head) and the norms load as floats, as without blocks
            assert isinstance(weight, torch.Tensor) and torch.equal(weight, floats[name]), name


def test_fusion_and_tensor_parallel_cuts_keep_whole_blocks(tiny_llama, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0)
    config, floats = load_gguf(path)
    _, blocks = load_gguf(path, keep_blocks=True)
    p = "model.layers.0."
    qkv = cat_rows([blocks[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv.dequantize(), torch.cat([floats[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    shape = tp_shape(config, 2)  # 4 query / 2 KV heads of 16, intermediate 128: every cut on a 32-value block
    for rank in range(2):
        want = shard_weights(floats, config, shape, rank)
        got = shard_weights(blocks, config, shape, rank)
        for name in (p + "self_attn.q_proj.weight", p + "self_attn.o_proj.weight", p + "mlp.up_proj.weight",
                     p + "mlp.down_proj.weight"):
            assert isinstance(got[name], QuantizedWeight)
            assert torch.equal(got[name].dequantize(), want[name]), (rank, name)


def test_a_linear_tensor_without_a_kernel_is_one_error_naming_it(tiny_llama, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_llama, tmp_path / "q5.gguf", GGMLQuantizationType.Q5_0)
    load_gguf(path)  # dequantized to floats it loads
    with pytest.raises(UnsupportedQuantizationError, match=r"tensor blk\.0\.\w+\.weight .*is Q5_0.*Q4_0, Q4_1, Q8_0"):
        load_gguf(path, keep_blocks=True)


def test_gguf_quantization_of_a_safetensors_directory_is_one_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="--quantization gguf needs a GGUF file"):
        load_checkpoint(str(tiny_model_dir), quantization="gguf")


def test_a_corrupt_block_scale_is_refused_at_load(tiny_llama, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0)
    _, blocks = load_gguf(path, keep_blocks=True)
    weight = blocks["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(weight, QuantizedWeight)
    raw = bytearray(path.read_bytes())
    first_row = weight.data[0].numpy().tobytes()  # down_proj is not row-permuted: its first row is as stored
    at = raw.find(first_row)
    assert at > 0 and raw.find(first_row, at + 1) < 0
    raw[at : at + 2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_down\.weight.*non-finite scale"):
        load_gguf(path, keep_blocks=True)
