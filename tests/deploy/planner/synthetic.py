"""Synthetic profiles for the planner's tests: the curves of a made-up worker, with points lying on them, shaped
like SmolLM2-135M's on a small CPU (prefill ~0.5 ms a token, a decode step ~20 ms + 1 ms a sequence)."""

from __future__ import annotations

import dataclasses

from deploy.planner.profile import (DecodeFit, DecodePoint, HandoffFit, HandoffPoint, KVCapacity, ModelIdentity,
                                    PrefillFit, PrefillPoint, Profile, TransportProfile)

PREFILL = PrefillFit(intercept_s=0.01, per_token_s=0.0005, per_token_context_s=1e-7)
DECODE = DecodeFit(intercept_s=0.02, per_seq_s=0.001, per_seq_token_s=1e-6)
GRPC = HandoffFit(intercept_s=0.005, per_byte_s=1e-9)


def synthetic_profile(*, model: str = "smollm2-135m", identity: str = "sha256:1a02d2c24148c4f7bbae9ff4",
                      prefill: PrefillFit = PREFILL, decode: DecodeFit = DECODE, num_kv_blocks: int = 2912,
                      **engine: object) -> Profile:
    return Profile(
        model=ModelIdentity(name=model, identity=identity),
        engine={"device": "cpu", "dtype": "float32", "kv_cache_dtype": "auto", "quantization": "none",
                "block_size": 16, "max_num_seqs": 128, "max_num_batched_tokens": 2048, "max_model_len": 8192,
                "enable_prefix_caching": True, **engine},
        machine={"cpu_count": 2, "num_threads": 2, "device": "cpu", "device_name": "synthetic"},
        versions={"splitserve": "test"},
        prefill_points=tuple(PrefillPoint(num_new_tokens=n, num_cached_tokens=c, seconds=prefill.seconds(n, c))
                             for n, c in ((64, 0), (256, 0), (1024, 0), (256, 768))),
        prefill=prefill,
        decode_points=tuple(DecodePoint(batch_size=b, context_len=ctx, seconds=decode.seconds(b, ctx))
                            for b, ctx in ((1, 256), (8, 256), (32, 1024))),
        decode=decode,
        handoff={"grpc": TransportProfile(points=tuple(HandoffPoint(num_bytes=b, seconds=GRPC.seconds(b))
                                                       for b in (11_796_480, 47_185_920)), fit=GRPC)},
        kv=KVCapacity(num_blocks=num_kv_blocks, block_size=16, block_bytes=737_280),
        created="2026-11-26T00:00:00+00:00",
    )


def without_handoff(profile: Profile) -> Profile:
    return dataclasses.replace(profile, handoff={}, handoff_skipped={"grpc": "not measured"})
