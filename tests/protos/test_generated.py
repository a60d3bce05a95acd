"""The checked-in generated code is exactly what `python -m protos.generate` produces from the .proto files."""

from __future__ import annotations

from pathlib import Path

from protos.generate import PROTOS_DIR, generate, proto_files


def test_generated_code_is_reproducible(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert written, "no generated files"
    names = {p.name for p in written}
    for proto in proto_files():
        stem = proto.stem
        assert {f"{stem}_pb2.py", f"{stem}_pb2_grpc.py", f"{stem}_pb2.pyi"} <= names
    for path in written:
        checked_in = PROTOS_DIR / path.name
        assert checked_in.exists(), f"{checked_in.name} is not checked in: run python -m protos.generate"
        assert checked_in.read_bytes() == path.read_bytes(), (
            f"{checked_in.name} differs from the .proto files: run python -m protos.generate"
        )
    stale = {p.name for p in PROTOS_DIR.iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))} - names
    assert not stale, f"generated files without a .proto: {sorted(stale)}"


def test_messages_round_trip() -> None:
    from protos import kv_transfer_pb2, serving_pb2

    req = serving_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3])
    req.params.max_tokens = 4
    back = serving_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.prompt_token_ids == [1, 2, 3] and back.params.HasField("max_tokens")
    assert not back.params.HasField("temperature")
    layout = kv_transfer_pb2.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
    assert kv_transfer_pb2.KVLayout.FromString(layout.SerializeToString()) == layout
