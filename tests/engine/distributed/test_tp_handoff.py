"""KV handoffs between engines of different tensor-parallel sizes, through the workers' own source (HeldBlocks) and
reservation over real transports, with real rank processes.

The tiny model has 2 KV heads: TP 2 splits them (one a rank), TP 4 replicates each on two ranks. A prompt prefilled
at TP a and decoded at TP b gives the colocated TP 1 engine's greedy tokens; each wire block is one sender rank's
run of heads for one receiver rank, under its own CRC-32C (a corrupted one fails the handoff and commits nothing);
the bytes moved are the blocks' (each head once, or once per receiver rank that holds it); every block of every
engine comes back.
"""

from __future__ import annotations

import pytest
import torch

from kv_transfer.reservation import ReservationSink, ReservationState
from engine import SamplingParams
from kv_transfer.layout import KVChecksumError, KVHandoff, KVLayoutMismatch
from tests.engine.kv_harness import hand_off_prompt, steps_until_finished, transfer_link
from tests.engine.tiny_model import PROMPTS, assert_no_blocks_held, drain, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ENGINE = dict(block_size=4, num_kv_blocks=24, max_model_len=64, num_threads=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = PROMPTS[1]  # 10 tokens: 2 full blocks of 4 and a partly filled one


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):  # noqa: ANN001, ANN201
    """{tp: engine} for TP 1, 2 and 4 (and -2: a second TP 2 engine, to hand off to from the first), and the
    colocated TP 1 answer to PROMPT."""
    made = {tp: make_engine(tiny_checkpoint, tensor_parallel_size=abs(tp), **ENGINE) for tp in (1, 2, 4, -2)}
    reference = make_engine(tiny_checkpoint, **ENGINE)
    reference.add_request("ref", PROMPT, PARAMS)
    expected = steps_until_finished(reference, "ref")
    yield made, expected
    for engine in made.values():
        engine.close()


def _hand_off_and_decode(prefill, decode, transport: str, request_id: str) -> tuple[list[int], int, int]:  # noqa: ANN001
    """The decode engine's tokens, the bytes the handoff moved and the blocks it moved (those the decode engine's
    prefix cache did not hold already)."""
    sink = ReservationSink(decode.kv_blocks.layout, torch.device("cpu"))
    with transfer_link(transport, sink, torch.device("cpu")) as (sender, endpoint):
        moved: list[int] = []
        send = sender.send

        def counting_send(handoff, source, **kwargs):  # type: ignore[no-untyped-def]
            result = send(handoff, source, **kwargs)
            moved.append(result.num_bytes)
            return result

        sender.send = counting_send  # type: ignore[method-assign]
        reservation, first_token = hand_off_prompt(prefill, decode, sender, sink, endpoint, request_id, PROMPT,
                                                   PARAMS)
    assert reservation.state is ReservationState.COMMITTED
    decode.commit_remote(request_id, first_token, None)
    return steps_until_finished(decode, request_id), moved[0], 3 - reservation.first_block


@pytest.mark.parametrize(("sender_tp", "receiver_tp", "transport"), [
    (2, 1, "grpc"), (1, 2, "grpc"), (2, 2, "grpc"), (4, 1, "grpc"), (1, 4, "grpc"), (4, 2, "grpc"),
    (2, 1, "torch"), (1, 2, "torch"), (4, 2, "torch"),
    (2, 1, "inproc"), (1, 4, "inproc"),
])
def test_a_prompt_prefilled_at_one_size_decodes_at_another(engines, sender_tp: int, receiver_tp: int,
                                                           transport: str) -> None:
    made, expected = engines
    prefill, decode = made[sender_tp], made[-receiver_tp if receiver_tp == sender_tp else receiver_tp]
    request_id = f"r-{sender_tp}-{receiver_tp}-{transport}"
    tokens, num_bytes, num_blocks = _hand_off_and_decode(prefill, decode, transport, request_id)
    assert tokens == expected
    # Bytes: each block that travels (the decode engine's prefix cache may hold the first ones from an earlier
    # case), each of the 2 KV heads once per receiver rank holding it.
    full = prefill.kv_blocks.layout
    assert num_blocks >= 1
    head_bytes = full.block_bytes // full.num_kv_heads
    copies = max(1, receiver_tp // full.num_kv_heads)
    assert num_bytes == num_blocks * full.num_kv_heads * head_bytes * copies
    for engine in (prefill, decode):
        drain(engine)
        assert_no_blocks_held(engine)


def test_the_wire_blocks_of_a_handoff_name_their_ranks() -> None:
    from kv_transfer.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32",
                      tensor_parallel_size=4)
    handoff = KVHandoff(request_id="r", transfer_id="t", num_tokens=10, layout=layout, first_block=1,
                        receiver_tensor_parallel_size=1)
    # Ranks 0 and 2 send heads 0 and 1 (ranks 1 and 3 hold replicas), both to rank 0: 2 wire blocks a block.
    assert [(u.sender_rank, u.receiver_rank, u.receiver_heads) for u in handoff.wire.units] == [
        (0, 0, range(0, 1)), (2, 0, range(1, 2))]
    assert handoff.wire_indices == range(2, 6)
    assert handoff.num_bytes == 4 * handoff.wire_layout.block_bytes == 2 * layout.block_bytes // 1
    assert KVHandoff.from_proto(handoff.to_proto()) == handoff


def test_a_corrupted_slice_fails_the_handoff_and_every_block_comes_back(engines) -> None:
    made, _ = engines
    prefill, decode = made[2], made[1]
    sink = ReservationSink(decode.kv_blocks.layout, torch.device("cpu"))
    with transfer_link("grpc", sink, torch.device("cpu")) as (sender, endpoint):
        with pytest.raises(KVChecksumError):  # the last wire block: rank 1's head of the last block
            hand_off_prompt(prefill, decode, sender, sink, endpoint, "bad", PROMPT, PARAMS, corrupt_last_byte=True)
    decode.abort_request(["bad"])  # what the decode worker does with a failed reservation
    for engine in (prefill, decode):
        assert_no_blocks_held(engine)


def test_a_receiver_of_another_size_than_planned_is_refused_before_any_byte(engines) -> None:
    made, _ = engines
    decode = made[2]
    sink = ReservationSink(decode.kv_blocks.layout, torch.device("cpu"))
    handoff = KVHandoff(request_id="r", transfer_id="t", num_tokens=10, layout=made[1].kv_blocks.layout,
                        receiver_tensor_parallel_size=1)  # planned for a TP 1 receiver
    with pytest.raises(KVLayoutMismatch, match="tensor_parallel_size: ours 2, peer's 1"):
        sink.open(handoff)


def test_an_int8_cache_hands_its_slices_scales_and_all(tiny_checkpoint) -> None:  # noqa: ANN001
    """int8 blocks carry per-head scales: a slice takes its heads' scales with it, under its CRC-32C."""
    reference = make_engine(tiny_checkpoint, kv_cache_dtype="int8", **ENGINE)
    reference.add_request("ref", PROMPT, PARAMS)
    expected = steps_until_finished(reference, "ref")
    prefill = make_engine(tiny_checkpoint, kv_cache_dtype="int8", tensor_parallel_size=2, **ENGINE)
    decode = make_engine(tiny_checkpoint, kv_cache_dtype="int8", **ENGINE)
    try:
        assert prefill.kv_blocks.layout.quantized and prefill.kv_blocks.ranks[1][1] is not None
        tokens, _, _ = _hand_off_and_decode(prefill, decode, "grpc", "int8")
        assert tokens == expected
        for engine in (prefill, decode):
            drain(engine)
            assert_no_blocks_held(engine)
    finally:
        prefill.close()
