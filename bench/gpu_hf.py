"""bench/gpu.py's baseline: HF transformers `generate` on the same dummy weights, dtype and device."""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_floors import wall_s
from engine.model.config import ModelConfig


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
    """HF's model class for `config`, holding `weights` (our dummy weights use HF's names and layouts)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    cls = Qwen2Config if config.architecture == "qwen2" else LlamaConfig
    eos = list(config.eos_token_ids) or None
    hf_config = cls(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope, bos_token_id=config.bos_token_id, eos_token_id=eos,
        pad_token_id=config.eos_token_ids[0] if config.eos_token_ids else 0,
    )
    with torch.device(device):  # initialised there (fast on a GPU); .to() in case a version builds on the host
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"dummy weights do not fit HF's model: missing {missing}, unexpected {unexpected}")
    return model.eval()


@torch.inference_mode()
def measure_hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    input_ids = torch.tensor(prompts, device=device)  # [B, prompt_len]: same lengths, no padding
    mask = torch.ones_like(input_ids)

    def generate(n: int):
        return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)

    generate(2)  # warm-up
    out = None

    def run() -> None:
        nonlocal out
        out = generate(new_tokens)

    seconds = wall_s(run, device)
    assert out is not None
    produced = (out.shape[1] - input_ids.shape[1]) * input_ids.shape[0]
    if produced != input_ids.shape[0] * new_tokens:
        raise RuntimeError(f"HF generate produced {produced} tokens, expected {input_ids.shape[0] * new_tokens}")
    return produced / seconds
