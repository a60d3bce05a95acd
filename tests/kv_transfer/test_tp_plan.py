"""The plan of a handoff between tensor-parallel sizes: every receiver rank's every local head gets exactly one
source, no head reaches a receiver rank twice, a replicated head leaves one sender rank only, and the bytes add up
to what each receiver rank holds. Exhaustive over small head counts and every TP size that splits them."""

from __future__ import annotations

import dataclasses

import pytest

from kv_transfer.layout import KVLayout, KVLayoutMismatch
from kv_transfer.tp_plan import HeadSlice, TPHandoffPlan, plan_tp_handoff, rank_block_bytes

BASE = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype="bfloat16")


def _tp_sizes(num_kv_heads: int, limit: int = 16) -> list[int]:
    return [n for n in range(1, limit + 1) if num_kv_heads % n == 0 or n % num_kv_heads == 0]


def _layouts(num_kv_heads: int, a: int, b: int, kv_cache_dtype: str = "auto") -> tuple[KVLayout, KVLayout]:
    model = dataclasses.replace(BASE, num_kv_heads=num_kv_heads, kv_cache_dtype=kv_cache_dtype)
    return (dataclasses.replace(model, tensor_parallel_size=a), dataclasses.replace(model, tensor_parallel_size=b))


def _check_plan(plan: TPHandoffPlan) -> None:
    sender, receiver = plan.sender, plan.receiver
    senders_of_head: dict[int, set[int]] = {}
    for rank in range(receiver.tensor_parallel_size):
        held = receiver.kv_head_range(rank)
        sources: list[int | None] = [None] * len(held)  # each local head's sender rank
        got_heads: list[int] = []
        for s in plan.slices_to(rank):
            assert len(s.heads) == len(s.sender_heads) == len(s.receiver_heads) > 0
            sender_held = sender.kv_head_range(s.sender_rank)
            for g, ls, lr in zip(s.heads, s.sender_heads, s.receiver_heads, strict=True):
                assert sender_held[ls] == g and held[lr] == g  # the local indices name the global head
                assert sources[lr] is None, f"receiver rank {rank} local head {lr} has two sources"
                sources[lr] = s.sender_rank
                got_heads.append(g)
                senders_of_head.setdefault(g, set()).add(s.sender_rank)
        assert None not in sources, f"receiver rank {rank}: local heads without a source: {sources}"
        assert got_heads == list(held)  # in order, each once
        assert sum(s.num_bytes for s in plan.slices_to(rank)) == rank_block_bytes(receiver, rank)
    # a replicated head leaves one sender rank, whichever receiver ranks hold it
    assert all(len(ranks) == 1 for ranks in senders_of_head.values())
    assert sorted(senders_of_head) == list(range(sender.num_kv_heads))
    assert sum(len(plan.slices_from(r)) for r in range(sender.tensor_parallel_size)) == len(plan.slices)
    copies = max(1, receiver.tensor_parallel_size // receiver.num_kv_heads)  # receiver ranks holding each head
    assert plan.num_bytes_per_block == copies * dataclasses.replace(receiver, tensor_parallel_size=1).block_bytes


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_every_pair_of_tp_sizes_gives_each_receiver_head_one_source(num_kv_heads: int, kv_cache_dtype: str) -> None:
    sizes = _tp_sizes(num_kv_heads)
    for a in sizes:
        for b in sizes:
            _check_plan(plan_tp_handoff(*_layouts(num_kv_heads, a, b, kv_cache_dtype)))


def test_smollm2_three_heads() -> None:
    """SmolLM2's 3 KV heads: 1 → 3 splits, 3 → 1 gathers, 3 → 3 and 1 → 1 move each rank's heads as they are."""
    plan = plan_tp_handoff(*_layouts(3, 1, 3))
    assert [(s.sender_rank, s.receiver_rank, s.heads, s.sender_heads, s.receiver_heads) for s in plan.slices] == [
        (0, 0, range(0, 1), range(0, 1), range(0, 1)),
        (0, 1, range(1, 2), range(1, 2), range(0, 1)),
        (0, 2, range(2, 3), range(2, 3), range(0, 1)),
    ]
    plan = plan_tp_handoff(*_layouts(3, 3, 1))
    assert [(s.sender_rank, s.receiver_rank, s.sender_heads, s.receiver_heads) for s in plan.slices] == [
        (0, 0, range(0, 1), range(0, 1)), (1, 0, range(0, 1), range(1, 2)), (2, 0, range(0, 1), range(2, 3))]
    plan = plan_tp_handoff(*_layouts(3, 3, 3))
    assert [(s.sender_rank, s.receiver_rank) for s in plan.slices] == [(0, 0), (1, 1), (2, 2)]
    plan = plan_tp_handoff(*_layouts(3, 1, 1))
    one_block = 2 * 2 * 4 * 3 * 8 * 2  # layers, K/V, block size, heads, head dim, bfloat16
    assert plan.slices == (HeadSlice(sender_rank=0, receiver_rank=0, heads=range(3), sender_heads=range(3),
                                     receiver_heads=range(3), num_bytes=one_block),)


def test_eight_heads_split_and_gathered() -> None:
    plan = plan_tp_handoff(*_layouts(8, 2, 4))
    assert [(s.sender_rank, s.receiver_rank, s.sender_heads, s.receiver_heads) for s in plan.slices] == [
        (0, 0, range(0, 2), range(0, 2)), (0, 1, range(2, 4), range(0, 2)),
        (1, 2, range(0, 2), range(0, 2)), (1, 3, range(2, 4), range(0, 2))]
    plan = plan_tp_handoff(*_layouts(8, 4, 2))
    assert [(s.sender_rank, s.receiver_rank, s.sender_heads, s.receiver_heads) for s in plan.slices] == [
        (0, 0, range(0, 2), range(0, 2)), (1, 0, range(0, 2), range(2, 4)),
        (2, 1, range(0, 2), range(0, 2)), (3, 1, range(0, 2), range(2, 4))]


def test_replicated_heads_are_sent_by_the_lowest_rank_and_received_by_every_replica() -> None:
    # Hkv 8, 16 → 8: ranks 2k and 2k + 1 hold head k; rank 2k sends it, rank 2k + 1 sends nothing
    plan = plan_tp_handoff(*_layouts(8, 16, 8))
    assert [(s.sender_rank, s.receiver_rank) for s in plan.slices] == [(2 * k, k) for k in range(8)]
    assert all(plan.slices_from(2 * k + 1) == () for k in range(8))
    # 8 → 16: sender rank k sends its one head, k, to receiver ranks 2k and 2k + 1
    plan = plan_tp_handoff(*_layouts(8, 8, 16))
    assert [(s.sender_rank, s.receiver_rank, s.heads) for s in plan.slices] == [
        (r // 2, r, range(r // 2, r // 2 + 1)) for r in range(16)]
    # Hkv 2, 4 → 1: ranks 0 and 2 send, 1 and 3 hold replicas
    plan = plan_tp_handoff(*_layouts(2, 4, 1))
    assert [(s.sender_rank, s.sender_heads, s.receiver_heads) for s in plan.slices] == [
        (0, range(0, 1), range(0, 1)), (2, range(0, 1), range(1, 2))]


def test_layouts_of_different_models_are_refused_naming_both() -> None:
    sender, receiver = _layouts(8, 2, 4)
    other = dataclasses.replace(receiver, head_dim=16, block_size=8)
    with pytest.raises(KVLayoutMismatch, match="differ in head_dim, block_size") as info:
        plan_tp_handoff(sender, other)
    assert str(sender) in str(info.value) and str(other) in str(info.value)
    with pytest.raises(KVLayoutMismatch, match="kv_cache_dtype"):
        plan_tp_handoff(sender, dataclasses.replace(receiver, kv_cache_dtype="int8"))
    with pytest.raises(KVLayoutMismatch, match="receiver's tensor-parallel size 3 does not split its 8 KV heads"):
        plan_tp_handoff(sender, dataclasses.replace(receiver, tensor_parallel_size=3))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 8])
def test_the_lanes_of_a_handoff_partition_its_wire_blocks(num_kv_heads: int) -> None:
    """Each lane (sender rank, receiver rank) holds exactly its pair's units, in the plan's order; together the
    lanes hold every unit once, and a lane's wire blocks are the handoff's blocks times its units."""
    from kv_transfer.layout import KVHandoff
    from kv_transfer.tp_plan import wire_plan

    for a in _tp_sizes(num_kv_heads, 8):
        for b in _tp_sizes(num_kv_heads, 8):
            sender, receiver = _layouts(num_kv_heads, a, b)
            plan = wire_plan(sender, receiver)
            lanes = plan.lanes
            assert len(set(lanes)) == len(lanes)
            joined = [u for lane in lanes for u in plan.lane(*lane).units]
            assert sorted(joined, key=plan.units.index) == list(plan.units)
            handoff = KVHandoff(request_id="r", transfer_id="t", num_tokens=10, layout=sender, first_block=1,
                                receiver_tensor_parallel_size=b)
            assert handoff.all_lanes == lanes
            total = 0
            for lane in lanes:
                one = handoff.with_lane(*lane)
                assert all((u.sender_rank, u.receiver_rank) == lane for u in one.wire.units)
                assert one.wire_indices == range(one.units_per_block, 3 * one.units_per_block)
                assert KVHandoff.from_proto(one.to_proto()) == one
                total += one.num_bytes
            assert total == handoff.num_bytes


def test_a_lane_no_head_moves_along_is_refused() -> None:
    from kv_transfer.layout import KVHandoff

    sender, _ = _layouts(2, 2, 2)
    handoff = KVHandoff(request_id="r", transfer_id="t", num_tokens=10, layout=sender, receiver_tensor_parallel_size=2)
    assert handoff.all_lanes == ((0, 0), (1, 1))
    with pytest.raises(KVLayoutMismatch, match="no KV heads move from sender rank 0 to receiver rank 1"):
        handoff.with_lane(0, 1)
