"""`--kv-cache-dtype int8`: int8 KV with per-block-per-head scales, on the torch attention backend.

The accuracy bound, stated and tested here, over the test prompts (tests/engine/tiny_model.PROMPTS), 16 greedy
tokens each, int8 cache against the unquantized (float32) one; "agreeing tokens" count each output up to where it
first differs, and the logit difference is taken only there (the contexts are equal up to then):

    tiny model (logits spread ~19)       all 4 outputs identical (64/64 agreeing tokens); max |logit diff| 0.10 < 0.25
    SmolLM2-135M (slow; spread ~48)      2 of 4 identical, the others part at tokens 10 and 14: 56/64 agreeing
                                         tokens (87.5%), every output's first 10 equal; max |logit diff| 0.82 < 1.0

Greedy outputs part where the top two logits are closer than the quantization error; one scale per 16-token block
and head is coarse where a head has outlier channels (a per-token scale would buy accuracy with memory).

A block's int8 cache costs 4 B*D / (B*D + 4) times less than float32's (3.76x at the tiny model's B*D = 64, 3.98x
at SmolLM2's 1024): at least 3.5x the blocks in the same --kv-cache-memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from decode_worker.reservation import DecodeKVSink, Reservation, ReservationState
from deploy.cli import build_parser, main
from deploy.serve_args import controller_config_from_args
from engine import SamplingParams
from engine.attention.int8_kv import dequantize_slots, quantize_store
from kv_transfer.layout import KVChecksumError
from tests.engine.kv_harness import (
    agreement,
    greedy_with_logits,
    hand_off_prompt,
    steps_until_finished,
    transfer_link,
)
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE, make_engine

if TYPE_CHECKING:
    from deploy.controller import ControllerConfig

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TINY_LOGIT_BOUND = 0.25
SMOLLM2_LOGIT_BOUND = 1.0


def test_a_block_keeps_its_tokens_within_one_step_of_its_final_scale() -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 3, 4, 2, 8
    data = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 127, dtype=torch.int8)  # a previous owner's
    scales = torch.full((num_blocks, num_kv_heads), 100.0)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randn(1, num_kv_heads, head_dim, generator=gen) * (1 + i) for i in range(block_size)]
    slots = [block_size + i for i in range(block_size)]  # block 1, one token per step, growing in magnitude
    before = None
    for i, (token, slot) in enumerate(zip(tokens, slots, strict=True)):
        quantize_store(data, scales, token, torch.tensor([slot]))
        if i == 0:
            before = data[1, 0].clone()
    stored = torch.cat(tokens)  # [4, Hkv, D]
    absmax = stored.abs().amax(dim=(0, 2))  # [Hkv]
    # The stale scale (100) was dropped when the block was written at offset 0: the scale is this block's own.
    torch.testing.assert_close(scales[1], absmax / 127)
    restored = dequantize_slots(data, scales, torch.tensor(slots), torch.float32)
    assert ((restored - stored).abs() <= scales[1][None, :, None] * 1.0001).all()
    assert before is not None and not torch.equal(before, data[1, 0])  # requantized as the scale grew
    assert torch.equal(scales[0], torch.full((num_kv_heads,), 100.0))  # untouched blocks keep theirs
    # A token that does not raise the scale leaves the block's earlier tokens bit for bit.
    kept = data[1].clone()
    small = tokens[0] * 0
    quantize_store(data, scales, small, torch.tensor([block_size + 3]))
    assert torch.equal(data[1, :3], kept[:3])


def _llm(model_dir: Path, **engine: object):
    from engine.llm import LLM

    return LLM(model=str(model_dir), **{**TINY_ENGINE, **engine})  # type: ignore[arg-type]


def test_int8_fits_at_least_3_5_times_the_blocks(tiny_model_dir: Path) -> None:
    memory = {"num_kv_blocks": None, "kv_cache_memory_bytes": 1 << 20}
    fp32 = _llm(tiny_model_dir, **memory).engine
    int8 = _llm(tiny_model_dir, kv_cache_dtype="int8", **memory).engine

    assert int8.num_kv_blocks >= 3.5 * fp32.num_kv_blocks
    assert int8.runner.kv_cache.dtype == torch.int8 and int8.runner.kv_scales is not None
    used = int8.runner.kv_cache.nbytes + int8.runner.kv_scales.nbytes
    assert used <= 1 << 20 < used + used // int8.num_kv_blocks + 1  # the memory, to one block
    assert int8.hash_namespace.kv_dtype == "int8/float32" and fp32.hash_namespace.kv_dtype == "float32"
    assert int8.hash_namespace.root != fp32.hash_namespace.root


def test_int8_greedy_agrees_with_the_unquantized_cache(tiny_model_dir: Path) -> None:
    reference = greedy_with_logits(_llm(tiny_model_dir).engine, 16)
    llm = _llm(tiny_model_dir, kv_cache_dtype="int8")
    quantized = greedy_with_logits(llm.engine, 16)

    num_agreeing, max_diff = agreement(reference, quantized)
    assert num_agreeing == [16] * len(PROMPTS)
    assert 0 < max_diff < TINY_LOGIT_BOUND  # > 0: the cache really was quantized
    assert llm.engine.attention_backend_name == "torch-int8"
    assert llm.engine.block_pool.num_used_blocks == 0


def test_int8_blocks_come_back_after_an_abort(tiny_model_dir: Path) -> None:
    engine = _llm(tiny_model_dir, kv_cache_dtype="int8").engine
    engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.block_pool.num_used_blocks > 0
    engine.abort_request(["a"])
    assert engine.block_pool.num_used_blocks == 0


def test_int8_runs_through_generate_and_refuses_other_backends(tiny_model_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_ENGINE.items()]
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hello world", "--max-tokens", "3",
            "--ignore-eos", "--kv-cache-dtype", "int8", *flags]
    assert main(base) == 0
    assert capsys.readouterr().out.strip()

    assert main([*base, "--attention-backend", "cpu"]) == 2
    assert "int8 runs on the torch attention backend only, not 'cpu'" in capsys.readouterr().err


@pytest.mark.parametrize("transport", ["grpc", "torch", "ipc", "inproc"])
def test_serve_takes_int8_and_fp8_with_a_kv_handoff(tiny_model_dir: Path, transport: str) -> None:
    """Every transport carries int8 blocks with their scales and fp8 blocks as bytes."""

    def pools(kv_cache_dtype: str) -> ControllerConfig:
        return controller_config_from_args(build_parser().parse_args(
            ["serve", "--model", str(tiny_model_dir), "--kv-cache-dtype", kv_cache_dtype, "--no-prefix-index",
             "--kv-transport", transport]))

    config = pools("int8")
    assert config.engine.kv_cache_dtype == "int8"
    assert config.num_prefill_workers == config.num_decode_workers == 1
    assert pools("fp8").engine.kv_cache_dtype == "fp8"


@pytest.mark.parametrize("transport", ["grpc", "torch", "ipc", "inproc"])
def test_int8_handoff_decodes_what_the_colocated_engine_decodes(tiny_checkpoint, transport: str) -> None:
    """An int8 prefill engine hands its quantized blocks (values and scales, through the workers' own source and
    reservation over a real transport) to an int8 decode engine: greedy tokens equal the colocated int8 engine's
    token for token (the decode engine reads the very cache the colocated one would have), and every block of
    both engines comes back. A corrupted scale fails the checksum: nothing commits, every block comes back."""
    colocated, prefill, decode = (make_engine(tiny_checkpoint, kv_cache_dtype="int8") for _ in range(3))
    layout = decode.kv_blocks.layout  # what a worker over the engine names in its handoffs
    assert layout.kv_cache_dtype == "int8"
    assert layout == prefill.kv_blocks.layout != make_engine(tiny_checkpoint).kv_blocks.layout
    sink = DecodeKVSink(layout, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with transfer_link(transport, sink, torch.device("cpu")) as (sender, endpoint):

        def hand_off(request_id: str, prompt: str, *, corrupt_scale: bool = False) -> tuple[Reservation, int]:
            return hand_off_prompt(prefill, decode, sender, sink, endpoint, request_id, prompt, params,
                                   corrupt_last_byte=corrupt_scale)

        prompt = PROMPTS[1]  # 10 tokens: 2 full blocks of 4, and a partly filled one that decode goes on filling
        colocated.add_request("r", prompt, params)
        expected = steps_until_finished(colocated, "r")

        reservation, first_token = hand_off("r", prompt)
        assert reservation.state is ReservationState.COMMITTED
        decode.commit_remote("r", first_token, None)
        assert steps_until_finished(decode, "r") == expected

        with pytest.raises(KVChecksumError):
            hand_off("bad", PROMPTS[3], corrupt_scale=True)
        assert reservation.state is ReservationState.COMMITTED  # the earlier one, untouched
        decode.abort_request(["bad"])  # what the decode worker does with a failed reservation
    for engine in (colocated, prefill, decode):
        assert engine.block_pool.num_used_blocks == 0


@pytest.mark.slow
def test_int8_greedy_agrees_on_smollm2(smollm2_checkpoint) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def engine(**overrides: object) -> LLMEngine:
        config = EngineConfig(max_model_len=256, num_kv_blocks=64, **overrides)  # type: ignore[arg-type]
        return LLMEngine(config, smollm2_checkpoint)

    reference = greedy_with_logits(engine(), 16)
    int8 = engine(kv_cache_dtype="int8")
    quantized = greedy_with_logits(int8, 16)
    num_agreeing, max_diff = agreement(reference, quantized)
    assert sum(num_agreeing) >= 0.85 * 16 * len(PROMPTS)
    assert min(num_agreeing) >= 10
    assert 0 < max_diff < SMOLLM2_LOGIT_BOUND
    assert int8.block_pool.num_used_blocks == 0
