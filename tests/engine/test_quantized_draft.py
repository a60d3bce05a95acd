"""A quantized draft model (`--speculative-config` draft_model with "quantization", vLLM's key): the draft's linear
layers and head run quantized, the target's greedy outputs are what they are without speculation, drafts are
accepted (the tiny model drafting for itself, in int8: the few it gets wrong are rejected), every KV block comes
back; a method the device does not run is one error before the draft loads.
"""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.kernels.quantized_weight import QuantFormat
from tests.engine.tiny_model import PROMPTS, assert_no_blocks_held, drain, finals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _greedy_outputs(engine, max_tokens: int = 16) -> dict[str, list[int]]:  # noqa: ANN001
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens))
    return {rid: out.token_ids for rid, out in finals(drain(engine)).items()}


def test_the_key_is_checked() -> None:
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "quantization": "int8"})
    assert spec.quantization == "int8"
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "m"}).quantization == "none"
    with pytest.raises(ValueError, match="speculative quantization must be one of"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "quantization": "awq"})
    with pytest.raises(ValueError, match="drafts with no weights of its own"):
        SpeculativeConfig.from_dict({"method": "ngram", "quantization": "int8"})


def test_int8_draft_keeps_the_targets_greedy_outputs(tiny_checkpoint) -> None:  # noqa: ANN001
    expected = _greedy_outputs(make_engine(tiny_checkpoint))
    engine = make_engine(tiny_checkpoint, speculative_config={
        "method": "draft_model", "model": str(tiny_checkpoint.path), "num_speculative_tokens": 3, "policy": "fixed",
        "quantization": "int8"})
    draft = engine.speculator.proposer.model
    linears = [lin for layer in draft.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert {lin.quantized.format for lin in [*linears, draft.lm_head]} == {QuantFormat.INT8}
    target = engine.runner.model
    assert target.layers[0].qkv.quantized is None  # the target keeps its own (float) weights
    assert _greedy_outputs(engine) == expected
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert_no_blocks_held(engine)


def test_a_draft_quantization_the_device_does_not_run_is_refused_before_loading(tiny_checkpoint) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="fp8 needs cuda"):
        make_engine(tiny_checkpoint, speculative_config={
            "method": "draft_model", "model": "/nonexistent/draft", "quantization": "fp8"})


def test_gguf_draft_runs_its_blocks(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """"quantization": "gguf": the draft is loaded with its GGUF blocks kept (here the loader is handed the tiny
    model's weights in Q8_0 blocks, as a GGUF file of them would load) and its layers run them; the float
    target's greedy outputs are unchanged and drafts are accepted."""
    import dataclasses

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from engine import engine_builder
    from engine.kernels.quantized_weight import QuantizedWeight
    from engine.model.quantization import is_linear_weight

    q8_0 = GGMLQuantizationType.Q8_0
    blocks = {n: QuantizedWeight.from_gguf(quantize(w.numpy(), q8_0), q8_0, tuple(w.shape)) if is_linear_weight(n)
              else w for n, w in tiny_checkpoint.weights.items()}
    loads = []

    def load_checkpoint(path, *, dtype, quantization="none"):  # noqa: ANN001, ANN202
        loads.append((path, quantization))
        return dataclasses.replace(tiny_checkpoint, weights=blocks)

    monkeypatch.setattr(engine_builder, "load_checkpoint", load_checkpoint)
    expected = _greedy_outputs(make_engine(tiny_checkpoint))
    engine = make_engine(tiny_checkpoint, speculative_config={
        "method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 3, "policy": "fixed",
        "quantization": "gguf"})
    assert loads == [("draft.gguf", "gguf")]
    draft = engine.speculator.proposer.model
    linears = [lin for layer in draft.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert {lin.quantized.format for lin in [*linears, draft.lm_head]} == {QuantFormat.Q8_0}
    assert _greedy_outputs(engine) == expected
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert_no_blocks_held(engine)
