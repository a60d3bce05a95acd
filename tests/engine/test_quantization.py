"""`--quantization` through the engine, over the tiny random-weight model: the flag reaches EngineConfig and `LLM`;
fp8 on cpu is refused before any weight loads (the cuda path: tests/engine/kernels/test_cuda_quantized_linear.py,
tests/engine/test_gpu_quantization.py); int8 quantizes exactly the linear layers and the LM
head (not the embedding) and runs them through the quantized kernel; its blocks hash in their own namespace; at
tensor_parallel_size 2 (real rank processes) an int8 engine gives TP 1's int8 tokens, every logits row within 1e-3.
The real model's accuracy: tests/engine/test_quantization_accuracy.py.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_args import add_engine_args, engine_config_from_args
from engine.engine_builder import build_engine_parts
from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight
from tests.engine.tiny_model import PROMPTS, assert_no_blocks_held, drain, finals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_flag_reaches_the_engine_config() -> None:
    assert parse().quantization == "none"
    assert parse("--quantization", "int8").quantization == "int8"
    assert parse("--quantization", "gguf").quantization == "gguf"
    with pytest.raises(SystemExit):
        parse("--quantization", "awq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


def test_fp8_is_one_error_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="fp8 needs cuda"):
        EngineConfig(quantization="fp8", device="cpu")
    # device auto resolving to cpu: refused at build, before the (nonexistent) model is looked for
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp8 needs cuda"):
            build_engine_parts(EngineConfig(model="/nonexistent/model.gguf", quantization="fp8"))


def test_int8_quantizes_the_linear_layers_and_the_head_only(tiny_checkpoint) -> None:  # noqa: ANN001
    plain = make_engine(tiny_checkpoint)
    engine = make_engine(tiny_checkpoint, quantization="int8")
    model = engine.runner.model
    for layer in model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(linear.quantized, QuantizedWeight) and linear.quantized.format is QuantFormat.INT8
            assert linear.weight is None and linear.packed is None
    assert model.lm_head.quantized is not None and model.lm_head.quantized.format is QuantFormat.INT8
    assert isinstance(model.embed, torch.Tensor)  # the lookup stays float
    # the checkpoint, which other engines share, keeps its float weights
    assert all(isinstance(t, torch.Tensor) for t in tiny_checkpoint.weights.values())
    requests = {f"r{i}": (p, greedy(8)) for i, p in enumerate(PROMPTS)}
    outputs = {}
    for name, e in (("none", plain), ("int8", engine)):
        for rid, (prompt, params) in requests.items():
            e.add_request(rid, prompt, params)
        outputs[name] = {rid: out.token_ids for rid, out in finals(drain(e)).items()}
        assert_no_blocks_held(e)
    assert outputs["int8"].keys() == requests.keys()
    assert engine.hash_namespace.model == plain.hash_namespace.model + "+int8"
    assert engine.hash_namespace.root != plain.hash_namespace.root


def test_int8_logits_are_the_dequantized_weights_logits(tiny_checkpoint) -> None:  # noqa: ANN001
    """The int8 engine computes with q * scale: replacing the float engine's weights by their int8 round trip gives
    the same logits (to float32 summation order), and they differ from the float weights' logits."""
    from engine.model.quantization import is_linear_weight, quantize_int8

    int8_weights = quantize_int8(tiny_checkpoint.weights)
    round_trip = {n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in int8_weights.items()}
    round_trip["lm_head.weight"] = QuantizedWeight.quantize_int8(round_trip["lm_head.weight"]).dequantize()
    assert sum(is_linear_weight(n) for n in round_trip) == 7 * tiny_checkpoint.config.num_layers
    import dataclasses

    engines = {
        "int8": make_engine(tiny_checkpoint, quantization="int8"),
        "round_trip": make_engine(dataclasses.replace(tiny_checkpoint, weights=round_trip)),
        "none": make_engine(tiny_checkpoint),
    }
    logits = {}
    for name, engine in engines.items():
        ids = torch.tensor(engine.tokenizer.encode(PROMPTS[0]))
        logits[name] = _prefill_logits(engine, ids)
    torch.testing.assert_close(logits["int8"], logits["round_trip"], rtol=0, atol=1e-4)
    assert (logits["int8"] - logits["none"]).abs().max() > 1e-3


def _prefill_logits(engine, ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The last position's logits of one prompt, through the engine's own model and KV cache."""
    from engine.request.sampling_params import SamplingParams

    engine.add_request("logits", ids.tolist(), SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    out = finals(drain(engine))["logits"]
    assert out.prompt_logprobs is not None
    # log p(t_j | t_<j), j >= 1: what the model computes, at every position of the prompt
    return torch.tensor([entry.logprob for entry in out.prompt_logprobs])


def test_int8_at_tensor_parallel_2_matches_tp1(tiny_checkpoint) -> None:  # noqa: ANN001
    from tests.engine.distributed.test_tensor_parallel import ENGINE, Pair

    pair = Pair(tiny_checkpoint, 2, **ENGINE, quantization="int8")
    try:
        local = pair.tpn.runner.model.local
        assert isinstance(local.layers[0].down.quantized, QuantizedWeight)  # a row-parallel int8 shard
        pair.check({f"r{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS)})
    finally:
        pair.close()


@pytest.mark.parametrize("fmt", [QuantFormat.Q8_0, QuantFormat.Q4_1, QuantFormat.INT8], ids=lambda f: f.label)
def test_rows_decode_to_the_whole_tables_values(fmt: QuantFormat) -> None:
    from gguf.quants import quantize

    table = torch.randn(50, 96, generator=torch.Generator().manual_seed(3))
    if fmt is QuantFormat.INT8:
        weight = QuantizedWeight.quantize_int8(table)
    else:
        weight = QuantizedWeight.from_gguf(quantize(table.numpy(), fmt.ggml_type), fmt.ggml_type, (50, 96))
    ids = torch.tensor([3, 0, 49, 3, 17])
    assert torch.equal(weight.dequantize_rows(ids), weight.dequantize()[ids])


def test_lookups_read_the_q8_0_head_only_where_it_holds_the_float_table_exactly() -> None:
    """A GGUF model's tied head (Q8_0) replaces the float embedding table only when its rows decode to exactly
    the table: a table that is not already Q8_0 values (quantization error), or an int8 head, keeps the table."""
    from engine.model.parallel_layers import VocabParallelEmbedding
    from engine.model.quantization import head_holds_embedding, quantize_head

    table = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    head = quantize_head(table, QuantFormat.Q4_1)
    assert head.format is QuantFormat.Q8_0 and not head_holds_embedding(head, table)
    exact = head.dequantize()  # what a GGUF file's Q8_0 embedding dequantizes to at load
    assert head_holds_embedding(head, exact)
    assert not head_holds_embedding(QuantizedWeight.quantize_int8(exact), exact)
    assert not head_holds_embedding(head, exact.double())
    ids = torch.tensor([[5, 63, 0], [5, 1, 2]])
    assert torch.equal(VocabParallelEmbedding(head, vocab_size=64)(ids), torch.nn.functional.embedding(ids, exact))
    # at tensor parallelism each rank looks up in its vocabulary rows of the head (a stand-in group: the all-reduce
    # is the sum of the ranks' outputs, taken here by hand)
    from types import SimpleNamespace

    groups = [SimpleNamespace(rank=r, size=4, all_reduce=lambda x: x) for r in range(4)]
    ranks = [VocabParallelEmbedding(head.rows(16 * r, 16 * (r + 1)), g, vocab_size=64) for r, g in enumerate(groups)]
    assert torch.equal(sum(rank(ids) for rank in ranks), torch.nn.functional.embedding(ids, exact))
