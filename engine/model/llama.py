"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flattened, paged batch.

Weights come in with HF names and layouts ([out_features, in_features]). At load, q/k/v and gate/up are fused
into one matrix each, so a layer runs four GEMMs instead of seven (`linear.py`: how they run). Inference only: no
autograd, no modules.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, RotaryAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu_elementwise import load_elementwise
from engine.lora.lora_step import LoRAStep
from engine.model.config import ModelConfig
from engine.model.quantization import Weight, cat_rows, head_holds_embedding, quantize_head
from engine.model.tp_group import SINGLE, TPGroup
from engine.model.linear import Linear
from engine.model.parallel_layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                          VocabParallelHead)
from engine.model.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The same op order as HF's LlamaRMSNorm (float32 statistics, weight applied after the cast back).
    xf = x.to(torch.float32)
    mean_square = xf.pow(2).mean(-1, keepdim=True)
    kernel = load_elementwise() if x.dim() == 2 and _fusable(x, weight) else None
    if kernel is not None:  # the rest in one pass, the same bits
        return kernel.rms_norm_scale(x, mean_square, weight, eps)
    xf = xf * torch.rsqrt(mean_square + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I] (HF's LlamaMLP activation)."""
    kernel = load_elementwise() if gate_up.dim() == 2 and _fusable(gate_up) else None
    if kernel is not None:  # one pass, the same bits
        return kernel.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _fusable(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # Shapes at TP 1; at TP N, H, Hkv and intermediate are this rank's (engine/distributed/tp_sizes.py).
    qkv: Linear  # [(H + 2*Hkv) * D, hidden], with the q/k/v bias where the model has one; column-parallel
    o: Linear  # [hidden, H * D]; row-parallel
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]; column-parallel
    down: Linear  # [hidden, intermediate]; row-parallel


class MissingWeightError(KeyError):
    pass


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        attention: AttentionBackend,
        *,
        max_positions: int,
        group: TPGroup = SINGLE,
    ) -> None:
        """`weights` are this rank's shard (engine/distributed/sharding.py) and `config` its local shape (its query
        and KV heads, its intermediate size; the whole vocabulary); at TP 1 the whole model."""
        self.config = config
        self.group = group
        self.attention = attention
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

        def take(name: str) -> Weight:
            if name not in weights:
                raise MissingWeightError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        embed = take("model.embed_tokens.weight")  # [vocab (/ N, padded), hidden]
        self._dtype, self._device = embed.dtype, embed.device
        self.final_norm = take("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = None
            if c.attention_bias:
                qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=ColumnParallelLinear(cat_rows([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                                             qkv_bias),
                    o=RowParallelLinear(take(p + "self_attn.o_proj.weight"), group),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=ColumnParallelLinear(cat_rows([take(p + "mlp.gate_proj.weight"),
                                                            take(p + "mlp.up_proj.weight")])),
                    down=RowParallelLinear(take(p + "mlp.down_proj.weight"), group),
                )
            )
        head: Weight = embed if c.tie_word_embeddings else take("lm_head.weight")
        layer_weight = self.layers[0].qkv.quantized if self.layers else None
        if layer_weight is not None and isinstance(head, torch.Tensor):  # --quantization: the head too
            head = quantize_head(head, layer_weight.format)
        self.lm_head = VocabParallelHead(head, group, vocab_size=c.vocab_size)
        # The lookup table: the float embedding, or a GGUF model's tied Q8_0 head where its rows decode to exactly
        # the float table's values (the file stored the embedding in Q8_0), so that the float copy, as large as the
        # whole head in float32, is not kept.
        self.embed: Weight = head if c.tie_word_embeddings and head_holds_embedding(head, embed) else embed
        self.embedding = VocabParallelEmbedding(self.embed, group, vocab_size=c.vocab_size)
        # On a GPU the elementwise steps run as the fused Triton kernels of engine/kernels/triton/ (the residual add
        # with the RMSNorm after it, rotary with the KV store where the backend fuses them, SiLU-and-mul): four
        # launches a layer instead of ~20 small ones, which is most of a small model's decode step there.
        self.fused_kernels = self._device.type == "cuda" and importlib.util.find_spec("triton") is not None
        # The backend rotates q and k itself, in its KV store's launch (the Triton backend; not int8/fp8 caches).
        self.rotary_in_attention = isinstance(attention, RotaryAttentionBackend)
        self.rope = RotaryEmbedding(
            head_dim=c.head_dim,
            max_positions=max_positions,
            theta=c.rope_theta,
            scaling=c.rope_scaling,
            dtype=self._dtype,
            device=self._device,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are (the loader gives CPU tensors; the engine moves them to its device first)."""
        return self._device

    def first_layers(self, num_layers: int) -> LlamaModel:
        """The same model cut after its first `num_layers` layers (then the final norm and the head), sharing every
        weight: a layer-skip draft. Its forward takes those layers' KV caches only."""
        if not 1 <= num_layers < len(self.layers):
            raise ValueError(f"num_layers must be in [1, {len(self.layers)}), got {num_layers}")
        cut = copy.copy(self)
        cut.layers = self.layers[:num_layers]
        return cut

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        lora: LoRAStep | None = None,  # the LoRA adapters its tokens run under (engine/lora/); None: none
    ) -> torch.Tensor:  # [T, hidden], final-normed
        if self.fused_kernels:
            return self._forward_fused(input_ids, positions, kv_caches, meta, lora)
        c = self.config
        num_tokens = input_ids.shape[0]
        hidden = self.embedding(input_ids)
        cos_sin = self.rope.cos_sin(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            qkv = _with_lora(layer.qkv, x, lora, i, "qkv")
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, c.num_heads, c.head_dim)
            k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
            v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
            q, k = self.rope(cos_sin, q, k)
            attn = self.attention.forward(q, k, v, kv_cache, meta)
            # In place where the tensor is ours alone (`hidden` is a fresh embedding lookup, never aliased): the same
            # arithmetic, two fewer multi-MB allocations per layer.
            hidden.add_(_with_lora(layer.o, attn.view(num_tokens, self.q_size), lora, i, "o"))
            x = rms_norm(hidden, layer.post_norm, c.rms_norm_eps)
            hidden.add_(_with_lora(layer.down, silu_and_mul(_with_lora(layer.gate_up, x, lora, i, "gate_up")), lora, i,
                                   "down"))
        return rms_norm(hidden, self.final_norm, c.rms_norm_eps)

    def _forward_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """`forward` on the GPU: the same arithmetic (HF's rounding order, which the kernels keep), each layer's
        residual add fused into the RMSNorm that follows it, the embedding lookup into the first. No host sync: CUDA
        graphs capture it whole."""
        from engine.kernels.triton.rms_norm import embed_rms_norm
        from engine.kernels.triton.rms_norm import rms_norm as add_rms_norm
        from engine.kernels.triton.rotary import rotary
        from engine.kernels.triton.silu_and_mul import silu_and_mul as fused_silu_and_mul

        c = self.config
        num_tokens = input_ids.shape[0]
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]  # what follows each layer
        if self.group.size == 1:  # the whole table here: the lookup gathered by the first norm
            assert isinstance(self.embed, torch.Tensor)  # a float table on the GPU (head_holds_embedding)
            x, residual = embed_rms_norm(input_ids, self.embed, self.layers[0].input_norm, c.rms_norm_eps)  # [T, hidden]
        else:  # a vocabulary shard: the masked lookup and its all-reduce first
            x, residual = add_rms_norm(self.embedding(input_ids), self.layers[0].input_norm, c.rms_norm_eps)
        for i, (layer, kv_cache, next_norm) in enumerate(zip(self.layers, kv_caches, norms, strict=True)):
            qkv = _with_lora(layer.qkv, x, lora, i, "qkv")
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, c.num_heads, c.head_dim)
            k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
            v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
            if self.rotary_in_attention:
                attn = self.attention.forward_rotary(  # type: ignore[attr-defined]
                    q, k, v, kv_cache, meta, positions, self.rope.cos, self.rope.sin)
            else:
                rotary(q, k, positions, self.rope.cos, self.rope.sin)  # in place, inside qkv (ours alone)
                attn = self.attention.forward(q, k, v, kv_cache, meta)
            x, residual = add_rms_norm(_with_lora(layer.o, attn.reshape(num_tokens, self.q_size), lora, i, "o"),
                                       layer.post_norm, c.rms_norm_eps, residual)
            act = fused_silu_and_mul(_with_lora(layer.gate_up, x, lora, i, "gate_up"))
            x, residual = add_rms_norm(_with_lora(layer.down, act, lora, i, "down"), next_norm, c.rms_norm_eps,
                                       residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 (at TP N on rank 0; the other ranks get [n, 0])."""
        return self.lm_head(hidden).float()


def _with_lora(linear: Linear, x: torch.Tensor, lora: LoRAStep | None, layer: int, fused: str) -> torch.Tensor:
    """linear(x), plus the LoRA deltas of the tokens whose request runs under an adapter that targets it. A
    row-parallel layer's partial delta (this rank's columns of A) joins its partial output before its all-reduce
    (engine/distributed/lora_shards.py)."""
    if lora is None:
        return linear(x)
    if isinstance(linear, RowParallelLinear):
        return linear.group.all_reduce(lora.add(Linear.__call__(linear, x), x, layer, fused))
    return lora.add(linear(x), x, layer, fused)
