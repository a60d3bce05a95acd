"""A rank's slice of the HF-named weights (engine/loader/weight_layout.py), and the model shape that slice has.

    weight (HF layout, [out, in])        rank r holds                              kind
    q_proj (and its bias)                rows of its query heads                   column-parallel (with k, v: qkv)
    k_proj, v_proj (and biases)          rows of its KV heads (replicated heads:   column-parallel
                                         the one its query heads read)
    o_proj                               columns of its query heads                row-parallel
    gate_proj, up_proj                   rows of its intermediate range            column-parallel (gate_up)
    down_proj                            columns of its intermediate range         row-parallel
    embed_tokens, lm_head                rows of its vocabulary slice, padded      vocab-parallel
    *norm                                all of it                                 replicated

Each slice is a fresh contiguous tensor, so the whole one can be freed once every rank's slice is cut. A quantized
linear weight (`QuantizedWeight`, --quantization) is cut the same way in whole rows (`rows`) or whole blocks
(`columns`): a GGUF block is never split, and an int8 row keeps its one scale on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping

import torch

from engine.distributed.tp_sizes import TPShape, check_tp_size
from engine.kernels.quantized_weight import QuantizedWeight
from engine.model.config import ModelConfig


def tp_shape(config: ModelConfig, tp_size: int) -> TPShape:
    """`config` split `tp_size` ways, or TensorParallelSizeError naming its heads."""
    return check_tp_size(tp_size=tp_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                         intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                         model_name=config.name)


def local_model_config(config: ModelConfig, shape: TPShape) -> ModelConfig:
    """The shape one rank's model has: its query and KV heads, its intermediate size; the vocabulary whole (the
    logits rank 0 gathers cover all of it)."""
    if shape.tp_size == 1:
        return config
    return dataclasses.replace(config, num_heads=shape.num_local_heads, num_kv_heads=shape.num_local_kv_heads,
                               intermediate_size=shape.local_intermediate_size)


def shard_weights(weights: MutableMapping[str, torch.Tensor], config: ModelConfig, shape: TPShape, rank: int, *,
                  consume: bool = False) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every weight (module docstring), same names. With `consume`, each whole tensor is
    popped from `weights` as its slice is cut (its memory goes as soon as nobody else holds it)."""
    if shape.tp_size == 1:
        out = dict(weights)
        if consume:
            weights.clear()
        return out
    d = config.head_dim
    heads, kv_heads = shape.head_range(rank), shape.kv_head_range(rank)
    q_rows = slice(heads.start * d, heads.stop * d)
    kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
    inter = shape.intermediate_range(rank)
    inter_rows = slice(inter.start, inter.stop)
    out: dict[str, torch.Tensor] = {}
    for name in list(weights):
        tensor = weights.pop(name) if consume else weights[name]
        out[name] = _slice(name, tensor, shape, rank, q_rows=q_rows, kv_rows=kv_rows, inter_rows=inter_rows)
    return out


def shard_all(weights: MutableMapping[str, torch.Tensor], config: ModelConfig, shape: TPShape
              ) -> list[dict[str, torch.Tensor]]:
    """Every rank's slice, cut in one pass that pops each whole tensor from `weights` once its slices are cut: the
    whole model is never held twice (`weights` ends empty)."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(shape.tp_size)]
    for name in list(weights):
        tensor = {name: weights.pop(name)}
        for rank, shard in enumerate(shards):
            shard.update(shard_weights(tensor, config, shape, rank))
    return shards


def _slice(name: str, tensor: torch.Tensor | QuantizedWeight, shape: TPShape, rank: int, *, q_rows: slice,
           kv_rows: slice, inter_rows: slice) -> torch.Tensor | QuantizedWeight:
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
    if isinstance(tensor, QuantizedWeight):
        return _slice_quantized(name, leaf, tensor, q_rows=q_rows, kv_rows=kv_rows, inter_rows=inter_rows)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(tensor, shape, rank)
    if leaf == "q_proj":
        return tensor[q_rows].clone()
    if leaf in ("k_proj", "v_proj"):
        return tensor[kv_rows].clone()
    if leaf == "o_proj":
        return tensor[:, q_rows].contiguous()
    if leaf in ("gate_proj", "up_proj"):
        return tensor[inter_rows].clone()
    if leaf == "down_proj":
        return tensor[:, inter_rows].contiguous()
    if name.endswith("norm.weight"):
        return tensor  # replicated
    raise ValueError(f"no tensor-parallel split known for weight {name!r}")


def _slice_quantized(name: str, leaf: str, weight: QuantizedWeight, *, q_rows: slice, kv_rows: slice,
                     inter_rows: slice) -> QuantizedWeight:
    """A quantized linear weight's slice, in fresh memory (the whole one can go once every rank's is cut)."""
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": inter_rows, "up_proj": inter_rows}
    columns = {"o_proj": q_rows, "down_proj": inter_rows}
    if leaf in rows:
        cut = weight.rows(rows[leaf].start, rows[leaf].stop)
    elif leaf in columns:  # a ValueError if the cut is not on a block boundary
        cut = weight.columns(columns[leaf].start, columns[leaf].stop)
    else:
        raise ValueError(f"no tensor-parallel split known for quantized weight {name!r}")
    return QuantizedWeight(format=cut.format, data=cut.data.clone(), in_features=cut.in_features,
                           scales=None if cut.scales is None else cut.scales.clone())


def _vocab_rows(tensor: torch.Tensor, shape: TPShape, rank: int) -> torch.Tensor:
    """Rows of `rank`'s vocabulary slice, zero-padded to `vocab_shard_size` rows."""
    rows = shape.vocab_range(rank)
    out = tensor.new_zeros((shape.vocab_shard_size, tensor.shape[1]))
    out[: len(rows)] = tensor[rows.start : rows.stop]
    return out
