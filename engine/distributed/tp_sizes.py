"""Which tensor-parallel sizes a model takes, and what each rank holds. Pure arithmetic, no torch.

As vLLM: N must divide the query heads (each rank gets H/N of them) and the MLP's intermediate size; the KV heads
are split when N divides them (Hkv/N a rank) and replicated when they divide N (one KV head a rank, the ranks of
each group of N/Hkv sharing a head: every rank's query heads read only their own group's KV head). Anything else is
refused at start-up, naming the model's heads.

    Hkv = 8, N = 4   ranks:  0        1        2        3          query heads 32: 8 a rank
                     KV:     [0, 2)   [2, 4)   [4, 6)   [6, 8)

    Hkv = 2, N = 4   ranks:  0        1        2        3          query heads 12: 3 a rank
                     KV:     [0, 1)   [0, 1)   [1, 2)   [1, 2)     (each KV head on N / Hkv = 2 ranks)

The vocabulary (embedding and LM head) is split in equal slices of ceil(V / N) rows, the last padded with zero rows,
so that every rank's logits have one shape (what a gather needs); rank 0 cuts the padding off.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.layout import tp_kv_head_range


class TensorParallelSizeError(ValueError):
    """A model that cannot be split N ways: raised at start-up, before any rank starts."""


@dataclass(frozen=True, kw_only=True)
class TPShape:
    """A model's heads and sizes split `tp_size` ways. `check_tp_size` makes one (or refuses)."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def kv_replicated(self) -> bool:
        """Whether each KV head lives on several ranks (N > Hkv)."""
        return self.tp_size > self.num_kv_heads

    @property
    def num_local_kv_heads(self) -> int:
        return 1 if self.kv_replicated else self.num_kv_heads // self.tp_size

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def vocab_shard_size(self) -> int:
        """Rows of the embedding and the LM head a rank holds (the last rank's tail padded)."""
        return -(-self.vocab_size // self.tp_size)

    def head_range(self, rank: int) -> range:
        """The query heads of `rank`."""
        self._check_rank(rank)
        n = self.num_local_heads
        return range(rank * n, (rank + 1) * n)

    def kv_head_range(self, rank: int) -> range:
        """The KV heads of `rank` (one head, shared with N/Hkv - 1 other ranks, when replicated): the KV layout's
        rule (kv_transfer/layout.py), which a handoff between TP sizes reads too."""
        self._check_rank(rank)
        return tp_kv_head_range(self.num_kv_heads, self.tp_size, rank)

    def intermediate_range(self, rank: int) -> range:
        self._check_rank(rank)
        n = self.local_intermediate_size
        return range(rank * n, (rank + 1) * n)

    def vocab_range(self, rank: int) -> range:
        """The token ids whose embedding rows and logits `rank` holds (the last range may be short)."""
        self._check_rank(rank)
        n = self.vocab_shard_size
        return range(min(rank * n, self.vocab_size), min((rank + 1) * n, self.vocab_size))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside a tensor-parallel group of {self.tp_size}")


def check_tp_size(*, tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                  model_name: str = "the model") -> TPShape:
    """The split of a model `tp_size` ways, or one TensorParallelSizeError naming the model's heads and the sizes
    it does take."""
    if tp_size < 1:
        raise TensorParallelSizeError(f"tensor_parallel_size must be positive, got {tp_size}")
    heads = f"{model_name} has {num_heads} query heads and {num_kv_heads} KV heads"
    if num_heads % tp_size != 0:
        raise TensorParallelSizeError(
            f"tensor_parallel_size {tp_size} does not divide the query heads: {heads}; "
            f"sizes it takes: {', '.join(map(str, valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)))}")
    if num_kv_heads % tp_size != 0 and tp_size % num_kv_heads != 0:
        raise TensorParallelSizeError(
            f"tensor_parallel_size {tp_size} neither divides the KV heads nor is a multiple of them: {heads}; "
            f"sizes it takes: {', '.join(map(str, valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)))}")
    if intermediate_size % tp_size != 0:
        raise TensorParallelSizeError(
            f"tensor_parallel_size {tp_size} does not divide the MLP's intermediate size {intermediate_size} "
            f"({heads})")
    return TPShape(tp_size=tp_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   intermediate_size=intermediate_size, vocab_size=vocab_size)


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Every size a model of these heads takes (for the error message)."""
    return [n for n in range(1, num_heads + 1)
            if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
            and intermediate_size % n == 0]
