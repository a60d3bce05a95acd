"""Which KV heads move from which sender rank to which receiver rank in a handoff between tensor-parallel sizes.

No torch: pure arithmetic over `tp_kv_head_range`, unit-tested exhaustively.

A prefill engine of TP a and a decode engine of TP b of one model hold the same KV heads, spread differently
(kv_transfer/layout.py, `KVLayout.kv_head_range`). Every block of a handoff moves as slices: one slice for each
(sender rank, receiver rank) pair whose heads overlap, the overlap a contiguous run of heads, which is a
contiguous run of local heads on each side.

    Hkv 8, a 2 → b 4      sender ranks:    0: [0, 4)              1: [4, 8)
                          receiver ranks:  0: [0, 2)   1: [2, 4)  2: [4, 6)   3: [6, 8)
                          slices:          s0 local [0, 2) → r0 local [0, 2)    s0 local [2, 4) → r1 local [0, 2)
                                           s1 local [0, 2) → r2 local [0, 2)    s1 local [2, 4) → r3 local [0, 2)

    Hkv 2, a 4 → b 1      sender ranks:    0: [0, 1)  1: [0, 1)  2: [1, 2)  3: [1, 2)    (replicated)
                          receiver rank:   0: [0, 2)
                          slices:          s0 local [0, 1) → r0 local [0, 1)    s2 local [0, 1) → r0 local [1, 2)

A head held by several sender ranks (a > Hkv) is sent by one of them only, the lowest rank that holds it, so that
no receiver rank gets a head twice; a head held by several receiver ranks (b > Hkv) is received by each of them,
so that head's bytes cross the wire once per receiver rank that holds it.

A slice travels as a block of a model whose KV heads are the slice's (`slice_layout`): values
[num_layers, 2, block_size, num_heads, head_dim], then (int8) scales [num_layers, 2, num_heads] float32, with
its own CRC-32C (kv_transfer/tp_slices.py reads and writes them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

from kv_transfer.layout import KVLayout, KVLayoutMismatch


@dataclass(frozen=True, kw_only=True)
class HeadSlice:
    """One block's heads `heads` (global KV head indices) from sender rank `sender_rank`, where they are local heads
    `sender_heads`, to receiver rank `receiver_rank`, where they are local heads `receiver_heads`. `num_bytes`: the
    slice's wire bytes per block (values, and scales for int8)."""

    sender_rank: int
    receiver_rank: int
    heads: range
    sender_heads: range
    receiver_heads: range
    num_bytes: int


def slice_layout(layout: KVLayout, num_heads: int) -> KVLayout:
    """The layout one slice of `num_heads` KV heads travels in: `layout`'s, with only those heads, one rank."""
    return dataclasses.replace(layout, num_kv_heads=num_heads, tensor_parallel_size=1)


def rank_block_bytes(layout: KVLayout, rank: int) -> int:
    """The bytes of one block that rank `rank` of `layout`'s engine holds (its local heads' values and scales)."""
    return slice_layout(layout, len(layout.kv_head_range(rank))).block_bytes


def check_same_model(sender: KVLayout, receiver: KVLayout) -> None:
    """Raise KVLayoutMismatch, naming both layouts, unless they are one model's (every field but the tensor-parallel
    size equal) and each one's tensor-parallel size splits its KV heads."""
    diffs = [f.name for f in dataclasses.fields(KVLayout)
             if f.name != "tensor_parallel_size" and getattr(sender, f.name) != getattr(receiver, f.name)]
    problems = [f"they differ in {', '.join(diffs)}"] if diffs else []
    for side, layout in (("sender", sender), ("receiver", receiver)):
        n, hkv = layout.tensor_parallel_size, layout.num_kv_heads
        if hkv % n != 0 and n % hkv != 0:
            problems.append(f"the {side}'s tensor-parallel size {n} does not split its {hkv} KV heads")
    if problems:
        raise KVLayoutMismatch(f"no KV handoff between tensor-parallel layouts: {'; '.join(problems)} "
                               f"(sender {sender}, receiver {receiver})")


@dataclass(frozen=True)
class TPHandoffPlan:
    """The slices of every block of a handoff from `sender`'s ranks to `receiver`'s (`plan_tp_handoff` makes one).
    `slices` are ordered by receiver rank, then by head: for each receiver rank, its slices cover its local heads
    [0, n) in order, each exactly once."""

    sender: KVLayout
    receiver: KVLayout
    slices: tuple[HeadSlice, ...]

    def slices_from(self, sender_rank: int) -> tuple[HeadSlice, ...]:
        """What sender rank `sender_rank` sends (possibly nothing: a replica of a head another rank sends)."""
        return tuple(s for s in self.slices if s.sender_rank == sender_rank)

    def slices_to(self, receiver_rank: int) -> tuple[HeadSlice, ...]:
        """What receiver rank `receiver_rank` receives, its local heads in order."""
        return tuple(s for s in self.slices if s.receiver_rank == receiver_rank)

    @cached_property
    def num_bytes_per_block(self) -> int:
        """Wire bytes of one block, all slices: the model's block bytes times (b / Hkv) when the receiver replicates
        heads, else the model's block bytes."""
        return sum(s.num_bytes for s in self.slices)


def head_sender(layout: KVLayout, head: int) -> int:
    """The one rank of `layout`'s engine that sends KV head `head`: the lowest rank holding it."""
    for rank in range(layout.tensor_parallel_size):
        if head in layout.kv_head_range(rank):
            return rank
    raise ValueError(f"KV head {head} outside the {layout.num_kv_heads} heads")


def plan_tp_handoff(sender: KVLayout, receiver: KVLayout) -> TPHandoffPlan:
    """The slices that move a block from `sender`'s ranks to `receiver`'s (KVLayoutMismatch when they are not one
    model's). TP 1 → 1 is one slice of every head."""
    check_same_model(sender, receiver)
    slices: list[HeadSlice] = []
    for receiver_rank in range(receiver.tensor_parallel_size):
        wanted = receiver.kv_head_range(receiver_rank)
        head = wanted.start
        while head < wanted.stop:
            sender_rank = head_sender(sender, head)
            held = sender.kv_head_range(sender_rank)
            heads = range(head, min(held.stop, wanted.stop))  # contiguous: held and wanted are both runs
            slices.append(HeadSlice(
                sender_rank=sender_rank,
                receiver_rank=receiver_rank,
                heads=heads,
                sender_heads=range(heads.start - held.start, heads.stop - held.start),
                receiver_heads=range(heads.start - wanted.start, heads.stop - wanted.start),
                num_bytes=slice_layout(sender, len(heads)).block_bytes,
            ))
            head = heads.stop
    return TPHandoffPlan(sender, receiver, tuple(slices))


@dataclass(frozen=True, kw_only=True)
class WireUnit:
    """One wire block of a handoff's block: local heads `sender_heads` of sender rank `sender_rank` to local heads
    `receiver_heads` of receiver rank `receiver_rank` (as many heads on both sides)."""

    sender_rank: int
    receiver_rank: int
    sender_heads: range
    receiver_heads: range


@dataclass(frozen=True)
class WirePlan:
    """How a handoff's blocks travel as wire blocks, the unit every transport moves, checksums and counts.

    Each block goes as `units_per_block` wire blocks (the plan's slices, cut into runs of `heads_per_unit` heads so
    that every wire block of a handoff has one shape, `layout`): wire block `w` is unit `w % units_per_block` of
    block `w // units_per_block`. TP 1 → 1 is one unit of every head: a wire block is a whole block, as before
    tensor parallelism."""

    layout: KVLayout  # one wire block's: the sender's, with `heads_per_unit` heads, one rank
    units: tuple[WireUnit, ...]

    @property
    def units_per_block(self) -> int:
        return len(self.units)

    def unit(self, wire_index: int) -> tuple[int, WireUnit]:
        """(the block, the unit) wire block `wire_index` carries."""
        block, unit = divmod(wire_index, len(self.units))
        return block, self.units[unit]

    @property
    def lanes(self) -> tuple[tuple[int, int], ...]:
        """The (sender rank, receiver rank) pairs some unit moves between, in the units' order: the lanes a
        handoff's bytes take when each rank sends and receives its own (kv_transfer/rank_lanes.py)."""
        return tuple(dict.fromkeys((u.sender_rank, u.receiver_rank) for u in self.units))

    def lane(self, sender_rank: int, receiver_rank: int) -> WirePlan:
        """This plan's units from `sender_rank` to `receiver_rank` only, in order: one lane's wire blocks (wire block
        `w` of the lane is its unit `w % k` of block `w // k`, k its units a block). ValueError for a pair no unit
        moves between."""
        units = tuple(u for u in self.units if (u.sender_rank, u.receiver_rank) == (sender_rank, receiver_rank))
        if not units:
            raise ValueError(f"no KV heads move from sender rank {sender_rank} to receiver rank {receiver_rank}")
        return WirePlan(self.layout, units)


def wire_plan(sender: KVLayout, receiver: KVLayout) -> WirePlan:
    """The wire blocks of a handoff from `sender`'s ranks to `receiver`'s (KVLayoutMismatch when they are not one
    model's): `plan_tp_handoff`'s slices in its order, each cut into runs of the slices' greatest common head
    count."""
    plan = plan_tp_handoff(sender, receiver)
    heads = math.gcd(*(len(s.heads) for s in plan.slices))
    units = tuple(
        WireUnit(sender_rank=s.sender_rank, receiver_rank=s.receiver_rank,
                 sender_heads=range(s.sender_heads.start + i, s.sender_heads.start + i + heads),
                 receiver_heads=range(s.receiver_heads.start + i, s.receiver_heads.start + i + heads))
        for s in plan.slices for i in range(0, len(s.heads), heads)
    )
    return WirePlan(slice_layout(sender, heads), units)
