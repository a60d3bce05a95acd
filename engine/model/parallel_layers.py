"""The layer kinds of a tensor-parallel model (Megatron's split): each holds its rank's shard and does its own
collective, so the model code reads the same at any TP size. Over the group of one (`engine.distributed.group.SINGLE`)
every collective is a no-op and each kind computes exactly what the plain layer did.

    kind                       weight shard (rank r of N)                         collective
    ColumnParallelLinear       rows of its output features (q/k/v heads,          none: its output stays split
                               gate/up columns)
    RowParallelLinear          columns of its input features (o, down)            one all-reduce (sum) of its output
    VocabParallelEmbedding     rows [r*s, (r+1)*s) of the vocabulary,             masked lookup, one all-reduce
                               s = ceil(V/N), the last zero-padded
    VocabParallelHead          the same rows of the LM head (the embedding's      gather of the logits on rank 0
                               when tied)

A column-parallel layer followed by a row-parallel one needs nothing in between: attention works per head and the
MLP's activation per column, so each rank's slice goes straight into its slice of the next GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.quantized_weight import QuantizedWeight
from engine.model.linear import Linear
from engine.model.tp_group import SINGLE, TPGroup

# A column-parallel layer is a plain linear layer over its output rows: no collective.
ColumnParallelLinear = Linear


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r.T: `weight` is this rank's [out_features, in_features / N] columns and `x`
    its slice of the input features; the all-reduce leaves the whole y on every rank. No bias (Llama has none)."""

    __slots__ = ("group",)

    def __init__(self, weight: torch.Tensor | QuantizedWeight, group: TPGroup = SINGLE, *, pack: bool = True
                 ) -> None:
        super().__init__(weight, pack=pack)
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().__call__(x))


class VocabParallelHead(Linear):
    """Logits over the whole vocabulary, float32, on rank 0: each rank computes its [n, s] slice and rank 0 gathers
    them (and cuts the padding off). Other ranks get an empty [n, 0]: they have nothing to sample."""

    __slots__ = ("group", "vocab_size")

    def __init__(self, weight: torch.Tensor | QuantizedWeight, group: TPGroup = SINGLE, *, vocab_size: int,
                 pack: bool = True) -> None:
        super().__init__(weight, pack=pack)
        self.group = group
        self.vocab_size = vocab_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = super().__call__(x).float()  # [n, s]
        gathered = self.group.gather_last_dim(local)  # [n, N * s] on rank 0
        if gathered is None:
            return local[:, :0]
        return gathered if gathered.shape[-1] == self.vocab_size else gathered[:, : self.vocab_size]


class VocabParallelEmbedding:
    """Token ids -> [T, hidden] rows. Each rank looks up the ids in its slice (zero rows for the others' ids) and an
    all-reduce sums them: exactly one rank contributes each row, so the sum is exact. The table may be a
    QuantizedWeight (a GGUF model's tied Q8_0 head, whose rows are the float table's values): rows are decoded as
    they are looked up."""

    __slots__ = ("weight", "group", "vocab_start", "vocab_end")

    def __init__(self, weight: torch.Tensor | QuantizedWeight, group: TPGroup = SINGLE, *, vocab_size: int) -> None:
        self.weight = weight  # [s, hidden]
        self.group = group
        rows = weight.out_features if isinstance(weight, QuantizedWeight) else weight.shape[0]
        self.vocab_start = group.rank * rows
        self.vocab_end = min(self.vocab_start + rows, vocab_size)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.dequantize_rows(ids.reshape(-1)).view(*ids.shape, self.weight.in_features)
        return F.embedding(ids, self.weight)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._rows(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [T]
        rows = self._rows((input_ids - self.vocab_start) * mine)  # [T, hidden]
        rows.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.group.all_reduce(rows)
