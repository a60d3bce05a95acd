"""The dummy model shapes of `--load-format dummy` (engine/loader/dummy_weights.py makes their weights): their
configs, their tokenizers and their identities. No torch: the router loads a dummy shape's tokenizer from here.

    name            shape (the published config.json)                               tokenizer
    smollm2-135m    HuggingFaceTB/SmolLM2-135M-Instruct: 30 x 576, 9 heads / 3 KV, tied      the real one (the GGUF's)
    llama-3.2-1b    meta-llama/Llama-3.2-1B: 16 x 2048, 32 / 8, llama3 rope, tied   byte-level stand-in
    qwen2.5-1.5b    Qwen/Qwen2.5-1.5B: 28 x 1536, 12 / 2, q/k/v bias, tied          byte-level stand-in

The stand-in tokenizer, for shapes whose tokenizer is not here: ids 0-255 are the 256 bytes (GPT-2's byte
alphabet, no merges: text encodes to one id per UTF-8 byte), the model's EOS id is "<|endoftext|>", and every other
id decodes to "<id>", so whatever random weights generate prints as something. Token ids, not text, are what a
benchmark of these shapes measures.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from engine.loader.errors import ModelLoadError
from engine.model.config import ModelConfig, RopeScaling
from engine.tokenizer.bpe import BYTE_TO_UNICODE, AddedToken
from engine.tokenizer.pre_tokenizer import stages_for_name
from engine.tokenizer.spec import TokenizerSpec
from engine.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DUMMY_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="llama", name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_ids=(128001,),
    ),
    "qwen2.5-1.5b": ModelConfig(
        architecture="qwen2", name="qwen2.5-1.5b", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151643,),
    ),
}
_REAL_TOKENIZER = {"smollm2-135m": "smollm2-135m"}  # dummy shape -> the registered model whose tokenizer it uses


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of every tensor of `config` (no lm_head when tied), in a fixed order."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q_out, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_out),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,)}
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def dummy_model_config(name: str) -> ModelConfig:
    if name not in DUMMY_SHAPES:
        raise ModelLoadError(f"--load-format dummy: unknown shape {name!r}; known shapes: {', '.join(DUMMY_SHAPES)}")
    return DUMMY_SHAPES[name]


@functools.cache  # a Tokenizer is immutable; reading one out of a GGUF takes seconds
def dummy_tokenizer(name: str) -> Tokenizer:
    """The shape's real tokenizer where it is known here, else the byte-level stand-in. A machine that cannot fetch
    the real one (no network, as on a benchmark GPU host) gets the stand-in too, with a warning: token ids, not
    text, are what these shapes are for."""
    if name in _REAL_TOKENIZER:
        from engine.loader.model_registry import resolve_model

        try:
            path = resolve_model(_REAL_TOKENIZER[name])
        except (OSError, ModelLoadError) as exc:  # urllib's errors are OSErrors
            logger.warning("dummy %s: its tokenizer could not be fetched (%s); using the byte-level stand-in",
                           name, exc)
        else:
            from engine.loader.gguf_reader import open_gguf

            return Tokenizer.from_gguf(open_gguf(path))  # the fast reader; gguf's stock one takes ~3 CPU-s here
    return byte_level_tokenizer(dummy_model_config(name))


def byte_level_tokenizer(config: ModelConfig) -> Tokenizer:
    """The stand-in: 256 byte tokens, EOS as <|endoftext|>, every other id spelled "<id>" (module docstring)."""
    eos = config.eos_token_ids[0]
    vocab = {char: byte for byte, char in enumerate(BYTE_TO_UNICODE)}
    placeholders = {i: f"<{i}>" for i in range(256, config.vocab_size) if i != eos}
    return Tokenizer(TokenizerSpec(
        vocab=vocab,
        id_to_token=placeholders,
        merges=(),
        pre_tokenizer_stages=stages_for_name(None),
        added_tokens=(AddedToken(content="<|endoftext|>", id=eos, special=True),),
        eos_token_id=eos,
        source=f"byte-level stand-in for {config.name}",
    ))


def dummy_checkpoint_path(name: str) -> Path:
    """A checkpoint `path` that names no file: for messages only (dummy checkpoints carry their `model_id`)."""
    return Path(f"<dummy>/{name}")


def dummy_model_id(name: str, seed: int) -> str:
    """What namespaces a dummy checkpoint's KV block hashes: its shape and seed (the weights follow from them)."""
    return f"dummy:{name}:seed={seed}"
