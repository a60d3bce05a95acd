"""The KV contract: block layout arithmetic, compatibility checks, the handoff descriptor on the wire, checksums."""

from __future__ import annotations

import pytest

from kv_transfer.layout import (
    KVChecksumError,
    KVHandoff,
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    block_checksum,
    error_from_kind,
    error_kind,
)
from protos import kv_transfer_pb2

SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
SMOLLM2_INT8 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32",
                        kv_cache_dtype="int8")


def test_block_shape_and_bytes() -> None:
    assert SMOLLM2.block_shape == (30, 2, 16, 3, 64)
    assert SMOLLM2.block_bytes == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    half = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
    assert half.block_bytes == SMOLLM2.block_bytes // 2


def test_int8_block_is_its_values_then_its_scales_as_bytes() -> None:
    assert SMOLLM2_INT8.value_dtype == "int8" and SMOLLM2_INT8.quantized and not SMOLLM2.quantized
    assert SMOLLM2_INT8.block_shape == SMOLLM2.block_shape and SMOLLM2_INT8.scale_shape == (30, 2, 3)
    assert SMOLLM2_INT8.value_bytes == 30 * 2 * 16 * 3 * 64 and SMOLLM2_INT8.scale_bytes == 30 * 2 * 3 * 4
    assert SMOLLM2_INT8.block_bytes == 184_320 + 720
    assert (SMOLLM2_INT8.wire_dtype, SMOLLM2_INT8.wire_shape) == ("uint8", (185_040,))
    assert (SMOLLM2.wire_dtype, SMOLLM2.wire_shape) == ("float32", SMOLLM2.block_shape)
    assert SMOLLM2.scale_bytes == 0 and SMOLLM2.value_bytes == SMOLLM2.block_bytes


def test_layout_bytes_are_what_the_engine_cache_costs_per_block() -> None:
    from engine.kv_cache_dtype import kv_block_bytes  # torch: only this test needs the engine
    from engine.loader.dummy_weights import dummy_model_config
    import torch

    model = dummy_model_config("smollm2-135m")
    for layout in (SMOLLM2, SMOLLM2_INT8):
        assert layout.block_bytes == kv_block_bytes(model, 16, torch.float32, layout.kv_cache_dtype)


def test_kv_cache_dtype_travels_in_the_descriptor_and_a_mismatch_names_it() -> None:
    wire = kv_transfer_pb2.KVLayout.FromString(SMOLLM2_INT8.to_proto().SerializeToString())
    assert wire.kv_cache_dtype == "int8" and KVLayout.from_proto(wire) == SMOLLM2_INT8
    wire.kv_cache_dtype = ""  # a peer from before quantized handoffs: unquantized
    assert KVLayout.from_proto(wire) == SMOLLM2
    with pytest.raises(KVLayoutMismatch, match="kv_cache_dtype: ours 'int8', peer's 'auto'"):
        SMOLLM2_INT8.check_compatible(SMOLLM2)
    wire.kv_cache_dtype = "fp4"  # no such cache
    with pytest.raises(KVLayoutMismatch, match="invalid KV layout.*fp4"):
        KVLayout.from_proto(wire)
    with pytest.raises(ValueError, match="not 'fp4'"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="float32", kv_cache_dtype="fp4")


def test_an_fp8_block_travels_as_its_values_bytes_half_of_bfloat16s() -> None:
    from engine.kv_cache_dtype import kv_block_bytes  # torch: only this test needs the engine
    from engine.loader.dummy_weights import dummy_model_config
    import torch

    bf16 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
    fp8 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16", kv_cache_dtype="fp8")
    assert (fp8.value_dtype, fp8.wire_dtype, fp8.wire_shape) == ("float8_e4m3fn", "uint8", bf16.block_shape)
    assert not fp8.quantized and fp8.scale_bytes == 0  # no scales: the cache holds the values cast
    assert fp8.block_bytes * 2 == bf16.block_bytes == 368_640
    model = dummy_model_config("smollm2-135m")
    assert fp8.block_bytes == kv_block_bytes(model, 16, torch.bfloat16, "fp8")
    wire = kv_transfer_pb2.KVLayout.FromString(fp8.to_proto().SerializeToString())
    assert KVLayout.from_proto(wire) == fp8
    with pytest.raises(KVLayoutMismatch, match="kv_cache_dtype: ours 'fp8', peer's 'auto'"):
        fp8.check_compatible(bf16)


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (16, 1), (17, 2), (1000, 63)])
def test_handoff_counts_partly_filled_last_block(num_tokens: int, num_blocks: int) -> None:
    handoff = KVHandoff(request_id="r", transfer_id="t", num_tokens=num_tokens, layout=SMOLLM2)
    assert handoff.num_blocks == num_blocks
    assert handoff.num_bytes == num_blocks * SMOLLM2.block_bytes


@pytest.mark.parametrize(
    "kwargs",
    [{"dtype": "int8"}, {"num_layers": 0}, {"block_size": -1}, {"head_dim": 0}, {"num_kv_heads": 0}],
)
def test_invalid_layout_is_rejected(kwargs: dict) -> None:
    fields = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32", **kwargs}
    with pytest.raises(ValueError):
        KVLayout(**fields)


def test_compatible_layouts_pass() -> None:
    SMOLLM2.check_compatible(KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32"))


def test_mismatch_names_every_differing_field_ours_then_peers() -> None:
    theirs = KVLayout(num_layers=30, num_kv_heads=3, head_dim=128, block_size=16, dtype="bfloat16")
    with pytest.raises(KVLayoutMismatch) as info:
        SMOLLM2.check_compatible(theirs)
    message = str(info.value)
    assert "head_dim: ours 64, peer's 128" in message
    assert "dtype: ours 'float32', peer's 'bfloat16'" in message
    assert "num_layers" not in message and "block_size" not in message
    assert isinstance(info.value, KVTransferError)


def test_handoff_round_trips_through_its_descriptor() -> None:
    handoff = KVHandoff(
        request_id="req-1", transfer_id="tx-1", num_tokens=33, layout=SMOLLM2,
        block_hashes=(b"\x01" * 16, b"\x02" * 16), source_endpoint="10.0.0.1:50051", source_worker_id="prefill-0",
        transport="grpc", first_block=1,
    )
    wire = kv_transfer_pb2.KVHandoffDescriptor.FromString(handoff.to_proto().SerializeToString())
    assert wire.num_blocks == 3 and wire.first_block == 1
    assert KVHandoff.from_proto(wire) == handoff
    assert list(handoff.block_indices) == [1, 2] and handoff.num_bytes == 2 * SMOLLM2.block_bytes


def test_descriptor_whose_held_head_is_past_its_blocks_is_refused() -> None:
    wire = KVHandoff(request_id="r", transfer_id="t", num_tokens=33, layout=SMOLLM2).to_proto()
    wire.first_block = 4
    with pytest.raises(KVTransferError, match="first block 4 outside its 3 blocks"):
        KVHandoff.from_proto(wire)


def test_descriptor_with_inconsistent_block_count_is_refused() -> None:
    wire = KVHandoff(request_id="r", transfer_id="t", num_tokens=33, layout=SMOLLM2).to_proto()
    wire.num_blocks = 2
    with pytest.raises(KVTransferError, match="2 blocks declared for 33 tokens"):
        KVHandoff.from_proto(wire)


def test_descriptor_with_invalid_layout_is_a_layout_mismatch() -> None:
    wire = KVHandoff(request_id="r", transfer_id="t", num_tokens=4, layout=SMOLLM2).to_proto()
    wire.layout.dtype = "float64"
    with pytest.raises(KVLayoutMismatch, match="invalid KV layout"):
        KVHandoff.from_proto(wire)


def test_block_checksum_is_crc32c() -> None:
    assert block_checksum(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert block_checksum(memoryview(b"123456789")) == 0xE3069283
    assert block_checksum(memoryview(bytearray(b"123456789"))) == 0xE3069283


@pytest.mark.parametrize("exc", [KVTransferError("x"), KVLayoutMismatch("x"), KVChecksumError("x")])
def test_error_kind_round_trips_the_subclass(exc: KVTransferError) -> None:
    back = error_from_kind(error_kind(exc), "receiver said x")
    assert type(back) is type(exc) and str(back) == "receiver said x"
