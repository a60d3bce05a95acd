"""Tiny random-weight HF models, and a GGUF writer that mimics llama.cpp's converter.

The writer is written from the converter's documented behaviour, independently of the loader: it permutes
q/k rows the way convert_hf_to_gguf.py does for the "llama" architecture (and not for "qwen2"), so a loader
that forgot to undo the permutation, or undid it the wrong way, fails the round-trip tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from engine.model.config import ModelConfig, RopeScaling

VARIANTS = ("llama_tied", "llama_untied_rope3", "qwen2_bias")
TINY_DIMS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
BOS_ID, EOS_ID = 1, 2

# HF name pieces -> GGUF name pieces, as llama.cpp names them.
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


@dataclass(frozen=True)
class TinyModel:
    variant: str
    model: PreTrainedModel

    @property
    def arch(self) -> str:
        return self.model.config.model_type

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the loader must reproduce (no lm_head when tied, as the loader contract says)."""
        sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd


def build_tiny_model(variant: str, seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    if variant == "llama_tied":
        model: PreTrainedModel = LlamaForCausalLM(
            LlamaConfig(**TINY_DIMS, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        )
    elif variant == "llama_untied_rope3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 8.0, "original_max_position_embeddings": 256}
        model = LlamaForCausalLM(
            LlamaConfig(**TINY_DIMS, tie_word_embeddings=False, rope_parameters=rope, bos_token_id=BOS_ID,
                        eos_token_id=EOS_ID)
        )
    elif variant == "qwen2_bias":
        model = Qwen2ForCausalLM(
            Qwen2Config(**TINY_DIMS, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        )
    else:
        raise ValueError(variant)
    with torch.no_grad():
        # HF initialises norms to one and biases to zero; random values make any mix-up of names visible.
        for param in model.parameters():
            param.normal_()
    return TinyModel(variant, model.eval())


def _converter_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: within each head, interleave the two rotary halves.
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK[module]}.{suffix}"


def write_tiny_gguf(
    tiny: TinyModel,
    path: Path,
    matrix_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `tiny` as llama.cpp would: metadata, permuted q/k (llama only), 2-D weights in `matrix_type`,
    plus `extra_tensors` (F32, GGUF names) for tests of files with surprises in them."""
    cfg = tiny.model.config
    arch = cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp stores Llama-3 scaling as per-frequency divisors; HF's scaled inv_freq gives them to us.
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                                             / head_dim))
        scaled = tiny.model.model.rotary_emb.inv_freq.to(torch.float64)
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    for name, tensor in tiny.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            data = _converter_permute(data, heads)
        if data.ndim == 2 and matrix_type != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name(name), data)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path




def expected_config_for(tiny: TinyModel, name: str) -> ModelConfig:
    """The `ModelConfig` a loader must produce for `tiny`, derived from the HF config by hand."""
    cfg = tiny.model.config
    rope = cfg.rope_parameters
    scaling = None
    if rope.get("rope_type") == "llama3":
        scaling = RopeScaling(factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                              high_freq_factor=rope["high_freq_factor"],
                              original_max_position_embeddings=rope["original_max_position_embeddings"])
    return ModelConfig(
        architecture=cfg.model_type, name=name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=rope["rope_theta"], max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.model_type == "qwen2",
        rope_scaling=scaling, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,),
    )
