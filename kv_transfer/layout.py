"""The KV contract between peers: the layout of one block on the wire, the handoff descriptor, the errors.

No torch: the router and the control plane may import this.

One block on the wire is its values, then (a quantized cache only) their scales, each C-contiguous:

    values  [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]   of `dtype` (kv_cache_dtype auto)
                                                                          or int8    (kv_cache_dtype int8)
                                                                          or fp8 e4m3 (kv_cache_dtype fp8)
    scales  [num_layers, 2 (K, V), num_kv_heads]                          float32    (int8 only)

An unquantized block travels as one tensor of the values' shape and dtype; an int8 block as one uint8 tensor of
`block_bytes` (the values' bytes, then the scales'; `wire_shape`, `wire_dtype`), so that every transport moves
and checksums it as it moves any block: the CRC-32C covers the scales with the values; an fp8 block (no scales: the
cache holds the values cast, unscaled) as its values' bytes, a uint8 tensor of the values' shape, since not every
transport's collectives take float8. The bytes equal `engine.kv_cache_dtype.kv_block_bytes` (about a quarter of
float32's for int8, half of bfloat16's for fp8).

A handoff carries `num_blocks = ceil(num_tokens / block_size)` such blocks, in block-table order. The last block
may be partly filled; its tail bytes are whatever the sender's cache held and the receiver never reads them (an
int8 block's scales are whole: they cover the tokens written so far).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING

import crc32c

from protos import kv_transfer_pb2

if TYPE_CHECKING:
    from kv_transfer.tp_plan import WirePlan


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b: e.g. the blocks of `b` tokens that `a` tokens fill. The one copy everyone uses."""
    return -(-a // b)

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a handoff can carry, by `--kv-cache-dtype`: the model's dtype, int8 values with float32 scales, fp8 values.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
FP8_DTYPE = "float8_e4m3fn"  # torch's name of an fp8 cache's values
SCALE_DTYPE = "float32"  # an int8 block's scales (engine.kv_cache_dtype.SCALE_DTYPE)


class KVTransferError(RuntimeError):
    """A handoff failed: the peer refused it, died, timed out, or a block arrived corrupt."""


class KVTransferTimeout(KVTransferError):
    """The handoff's deadline passed before the receiver confirmed it (the sender's view)."""


class KVLayoutMismatch(KVTransferError):
    """Sender and receiver disagree on the block layout: refused before any byte moves."""


class KVChecksumError(KVTransferError):
    """A block's bytes do not match the checksum the sender computed."""


class KVRefused(KVTransferError):
    """The receiver refused a handoff it never asked for, or a stream that breaks the protocol; `reason` is the
    label of splitserve:kv_transfers_rejected_total (unknown_transfer | wrong_source | block_count | malformed)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def rejection_reason(exc: BaseException) -> str | None:
    """The rejection label of a receiver-side error; None for a failure that is no refusal (a timeout, a sender
    that went away)."""
    if isinstance(exc, KVLayoutMismatch):
        return "layout_mismatch"
    if isinstance(exc, KVChecksumError):
        return "checksum"
    if isinstance(exc, KVRefused):
        return exc.reason
    return None


def error_kind(exc: KVTransferError) -> kv_transfer_pb2.KVErrorKind.ValueType:
    """The wire tag of a receiver-side error, so that the sender re-raises the same subclass."""
    if isinstance(exc, KVLayoutMismatch):
        return kv_transfer_pb2.KV_ERROR_LAYOUT_MISMATCH
    if isinstance(exc, KVChecksumError):
        return kv_transfer_pb2.KV_ERROR_CHECKSUM
    return kv_transfer_pb2.KV_ERROR_UNSPECIFIED


def error_from_kind(kind: kv_transfer_pb2.KVErrorKind.ValueType, message: str) -> KVTransferError:
    """The inverse of `error_kind`: the exception a sender raises for a receiver's refusal."""
    if kind == kv_transfer_pb2.KV_ERROR_LAYOUT_MISMATCH:
        return KVLayoutMismatch(message)
    if kind == kv_transfer_pb2.KV_ERROR_CHECKSUM:
        return KVChecksumError(message)
    return KVTransferError(message)


def tp_kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads of rank `rank` of `tp_size`: Hkv / N of them when N divides Hkv; when Hkv divides N, the one
    head its query heads read, shared by N / Hkv ranks (vLLM's rule; engine/distributed/tp_sizes.py refuses any
    other size). E.g. Hkv 8, N 4: rank 1 holds [2, 4); Hkv 2, N 4: rank 1 holds [0, 1), rank 2 [1, 2)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of {tp_size}")
    if num_kv_heads % tp_size == 0:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads == 0:
        head = rank // (tp_size // num_kv_heads)
        return range(head, head + 1)
    raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the model's: what an unquantized cache holds, and what an int8 one's values were computed in
    kv_cache_dtype: str = "auto"  # peers of different `--kv-cache-dtype` never exchange blocks
    # The ranks of a tensor-parallel engine the model's `num_kv_heads` are spread over (`kv_head_range`); every rank
    # holds the same block ids. `block_shape` and the byte counts are the whole model's (all ranks' heads).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KV dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"a KV handoff carries kv_cache_dtype {' or '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tensor_parallel_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"KVLayout.{f} must be positive, got {getattr(self, f)}")

    def kv_head_range(self, rank: int) -> range:
        """The KV heads rank `rank` of the tensor-parallel engine holds (`tp_kv_head_range`)."""
        return tp_kv_head_range(self.num_kv_heads, self.tensor_parallel_size, rank)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def quantized(self) -> bool:
        """Whether a block carries scales after its values (int8)."""
        return self.kv_cache_dtype == "int8"

    @property
    def value_dtype(self) -> str:
        return {"int8": "int8", "fp8": FP8_DTYPE}.get(self.kv_cache_dtype, self.dtype)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        """[num_layers, 2 (K, V), num_kv_heads] float32: one block's scales (int8 only)."""
        return (self.num_layers, 2, self.num_kv_heads)

    @property
    def value_bytes(self) -> int:
        element_size = DTYPE_SIZES[self.dtype] if self.kv_cache_dtype == "auto" else 1
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * element_size

    @property
    def scale_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * DTYPE_SIZES[SCALE_DTYPE] if self.quantized else 0

    @property
    def block_bytes(self) -> int:
        """One block's bytes on the wire, scales included."""
        return self.value_bytes + self.scale_bytes

    @property
    def wire_dtype(self) -> str:
        """The dtype of a block's tensor as transports move it: the values' own, or bytes (uint8) for int8 and fp8."""
        return self.value_dtype if self.kv_cache_dtype == "auto" else "uint8"

    @property
    def wire_shape(self) -> tuple[int, ...]:
        """The shape of a block's tensor as transports move it: `block_shape`, or (`block_bytes`,) for int8."""
        return (self.block_bytes,) if self.quantized else self.block_shape

    def check_compatible(self, other: KVLayout) -> None:
        """Raise KVLayoutMismatch naming every field that differs (self is ours, other the peer's)."""
        diffs = [
            f"{f.name}: ours {getattr(self, f.name)!r}, peer's {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise KVLayoutMismatch("KV layout mismatch between peers (" + "; ".join(diffs) + ")")

    # The proto message's fields are the dataclass' fields, name for name.
    def to_proto(self) -> kv_transfer_pb2.KVLayout:
        return kv_transfer_pb2.KVLayout(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, msg: kv_transfer_pb2.KVLayout) -> KVLayout:
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        values["kv_cache_dtype"] = msg.kv_cache_dtype or "auto"  # unset: a peer from before quantized handoffs
        values["tensor_parallel_size"] = msg.tensor_parallel_size or 1  # unset: a peer from before tensor parallelism
        try:
            return cls(**values)
        except ValueError as exc:
            raise KVLayoutMismatch(f"peer sent an invalid KV layout: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class KVHandoff:
    """One request's KV handoff, as the sender opens it. `transfer_id` is unique per attempt.

    It covers the request's `num_tokens` tokens in `num_blocks` blocks, of which blocks [0, first_block) stay
    home: the receiver already holds them (a hit in its own prefix cache). The rest travel in order, each under
    its handoff-wide index (`block_indices`).

    Transports move wire blocks (`wire_indices`, each of `wire_layout`): a block's KV heads cut by which sender rank
    sends them to which receiver rank (`wire`, kv_transfer/tp_plan.py), `units_per_block` wire blocks a block.
    Between two engines of tensor-parallel size 1 a wire block is a whole block, and wire index = block index.
    """

    request_id: str
    transfer_id: str
    num_tokens: int
    layout: KVLayout
    block_hashes: tuple[bytes, ...] = field(default=())
    source_endpoint: str = ""
    source_worker_id: str = ""
    transport: str = ""
    first_block: int = 0
    receiver_tensor_parallel_size: int = 1
    # One lane of the handoff (kv_transfer/rank_lanes.py): only the wire blocks sender rank `lane[0]` sends to receiver
    # rank `lane[1]`, from that rank's process to that rank's. None: every wire block, through rank 0 on each side.
    lane: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.first_block <= self.num_blocks:
            raise KVTransferError(
                f"handoff {self.transfer_id}: first block {self.first_block} outside its {self.num_blocks} blocks"
            )
        if self.receiver_tensor_parallel_size < 1:
            raise KVTransferError(f"handoff {self.transfer_id}: receiver tensor-parallel size "
                                  f"{self.receiver_tensor_parallel_size}")

    def check_receiver(self, ours: KVLayout) -> None:
        """Raise KVLayoutMismatch, naming what differs, unless a receiver of layout `ours` can take this handoff: the
        same model and KV dtype, at the tensor-parallel size the sender planned for, which splits the heads."""
        ours.check_compatible(self.receiver_layout)
        _ = self.wire  # the plan: refused here, before any byte, when the sizes do not split the heads

    def check_reserved(self, *, request_id: str, source_endpoint: str, num_tokens: int, num_blocks: int,
                       first_block: int) -> None:
        """Raise KVRefused unless this handoff fits what the receiver reserved for `request_id`: it comes from
        `source_endpoint` ("": any), for `num_tokens` tokens in at most `num_blocks` blocks, the first
        `first_block` of which the receiver holds already."""
        if source_endpoint and self.source_endpoint != source_endpoint:
            raise KVRefused(f"request {request_id}: KV expected from {source_endpoint}, the handoff comes from "
                            f"{self.source_endpoint or 'an unnamed sender'}", reason="wrong_source")
        if self.num_tokens != num_tokens or self.num_blocks > num_blocks:
            raise KVRefused(f"request {request_id}: reserved {num_tokens} tokens in {num_blocks} blocks, the handoff "
                            f"carries {self.num_tokens} tokens in {self.num_blocks} blocks", reason="block_count")
        if self.first_block != first_block:
            raise KVRefused(f"request {request_id}: this worker holds the first {first_block} blocks, the handoff "
                            f"starts at block {self.first_block}", reason="block_count")

    @property
    def receiver_layout(self) -> KVLayout:
        """The layout the receiver must have: the sender's, at the receiver's tensor-parallel size."""
        return replace(self.layout, tensor_parallel_size=self.receiver_tensor_parallel_size)

    @cached_property
    def wire(self) -> WirePlan:
        """How each block travels (KVLayoutMismatch when the two tensor-parallel sizes cannot split the heads)."""
        from kv_transfer.tp_plan import wire_plan  # it builds on this module

        plan = wire_plan(self.layout, self.receiver_layout)
        if self.lane is None:
            return plan
        try:
            return plan.lane(*self.lane)
        except ValueError as exc:
            raise KVLayoutMismatch(f"handoff {self.transfer_id}: {exc}") from None

    @property
    def wire_id(self) -> str:
        """What names this handoff on the wire where several may be open at one receiver: the transfer id, and the
        lane's ranks for a lane (the lanes of one handoff share its transfer id)."""
        return self.transfer_id if self.lane is None else f"{self.transfer_id}#{self.lane[0]}-{self.lane[1]}"

    @property
    def all_lanes(self) -> tuple[tuple[int, int], ...]:
        """Every lane of the whole handoff (the (sender rank, receiver rank) pairs its heads move between), whichever
        lane this is."""
        from kv_transfer.tp_plan import wire_plan

        return wire_plan(self.layout, self.receiver_layout).lanes

    def with_lane(self, sender_rank: int, receiver_rank: int) -> KVHandoff:
        """This handoff's lane from `sender_rank` to `receiver_rank`: the same request, transfer id and blocks, only
        the wire blocks between those two ranks (KVLayoutMismatch for a pair no head moves between)."""
        lane = replace(self, lane=(sender_rank, receiver_rank))
        _ = lane.wire
        return lane

    @property
    def wire_layout(self) -> KVLayout:
        """One wire block's layout: what transports check shapes and sizes against."""
        return self.wire.layout

    @property
    def units_per_block(self) -> int:
        return self.wire.units_per_block

    @property
    def first_wire_block(self) -> int:
        return self.first_block * self.units_per_block

    @property
    def num_wire_blocks(self) -> int:
        """Wire blocks of the whole handoff, those of the blocks that stay home included."""
        return self.num_blocks * self.units_per_block

    @property
    def wire_indices(self) -> range:
        """The indices of the wire blocks that travel, in the order they travel."""
        return range(self.first_wire_block, self.num_wire_blocks)

    @property
    def num_blocks(self) -> int:
        return cdiv(self.num_tokens, self.layout.block_size)

    @property
    def block_indices(self) -> range:
        """The indices of the blocks that travel."""
        return range(self.first_block, self.num_blocks)

    @property
    def num_bytes(self) -> int:
        """Bytes that travel."""
        return len(self.wire_indices) * self.wire_layout.block_bytes

    def to_proto(self) -> kv_transfer_pb2.KVHandoffDescriptor:
        return kv_transfer_pb2.KVHandoffDescriptor(
            request_id=self.request_id,
            transfer_id=self.transfer_id,
            block_hashes=list(self.block_hashes),
            num_tokens=self.num_tokens,
            num_blocks=self.num_blocks,
            layout=self.layout.to_proto(),
            source_endpoint=self.source_endpoint,
            source_worker_id=self.source_worker_id,
            transport=self.transport,
            first_block=self.first_block,
            receiver_tensor_parallel_size=self.receiver_tensor_parallel_size,
            lane=self.lane is not None,
            lane_sender_rank=self.lane[0] if self.lane is not None else 0,
            lane_receiver_rank=self.lane[1] if self.lane is not None else 0,
        )

    @classmethod
    def from_proto(cls, msg: kv_transfer_pb2.KVHandoffDescriptor) -> KVHandoff:
        handoff = cls(
            request_id=msg.request_id,
            transfer_id=msg.transfer_id,
            num_tokens=msg.num_tokens,
            layout=KVLayout.from_proto(msg.layout),
            block_hashes=tuple(msg.block_hashes),
            source_endpoint=msg.source_endpoint,
            source_worker_id=msg.source_worker_id,
            transport=msg.transport,
            first_block=msg.first_block,
            receiver_tensor_parallel_size=msg.receiver_tensor_parallel_size or 1,
            lane=(msg.lane_sender_rank, msg.lane_receiver_rank) if msg.lane else None,
        )
        if msg.num_blocks != handoff.num_blocks:
            raise KVTransferError(
                f"handoff {msg.transfer_id}: {msg.num_blocks} blocks declared for {msg.num_tokens} tokens "
                f"of block size {handoff.layout.block_size}"
            )
        return handoff


def block_checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C (Castagnoli; hardware-accelerated by the `crc32c` package, >10 GB/s where zlib's CRC-32 managed
    ~2.5) of one block's bytes: what travels with every block and what the receiver verifies. `value` continues
    the CRC of the bytes before `data`."""
    return crc32c.crc32c(data, value)
