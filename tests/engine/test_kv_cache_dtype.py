"""`--kv-cache-dtype int8`: int8 KV with per-block-per-head scales, on the torch attention backend.

The accuracy bound, stated and tested here: a fixed English text (TEXT) runs teacher-forced through the cache in
small prefill chunks, so that every chunk after the first reads its context from the cache (quantized blocks, in
an int8 cache) and blocks are written in parts (a later part that raises a block's scale requantizes the earlier
one); the int8 cache is held to the unquantized (float32) one's logits on the very same positions:

    tiny model (random weights, logits spread ~19; chunks of 3, blocks of 4)
        max |logit diff| over every position < 0.15                       (measured 0.057)
    SmolLM2-135M (slow; chunks of 8, blocks of 16; 162 positions)
        perplexity of the text within 2% of the float32 cache's:
        |ln(ppl_int8 / ppl_float32)| = |mean NLL difference| < 0.02 nats  (measured -0.003, 1.0008x on an Intel VM)

Neither measure chooses a token, so neither depends on which of two nearly tied logits a CPU's rounding puts
first (greedy agreement did: 56/64 tokens on one machine, 48/64 on another, for the same cache). Each bound is
shown to have teeth: dequantizing with a scale 10% too large breaks both (max diff ~1.0 on the tiny model,
perplexity 1.10x on SmolLM2), as do swapped heads' scales or a block whose earlier tokens are not requantized
(1.18x) — see `_scale_read_10_percent_large`.

A block's int8 cache costs 4 B*D / (B*D + 4) times less than float32's (3.76x at the tiny model's B*D = 64, 3.98x
at SmolLM2's 1024): at least 3.5x the blocks in the same --kv-cache-memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from kv_transfer.reservation import ReservationSink, Reservation, ReservationState
from deploy.cli import build_parser, main
from deploy.serve_args import controller_config_from_args
from engine import SamplingParams
from engine.attention import int8_kv
from engine.attention.int8_kv import dequantize_slots, quantize_store
from kv_transfer.layout import KVChecksumError
from tests.engine.kv_harness import hand_off_prompt, prompt_logits, steps_until_finished, transfer_link
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE, make_engine

if TYPE_CHECKING:
    from deploy.controller import ControllerConfig

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# A fixed text for teacher-forced measures (what it says matters only to SmolLM2, which finds it plain English).
TEXT = (
    "The river rises in the hills above the town and runs for forty miles before it reaches the sea. In spring the "
    "snow melts and the water comes down fast and brown, carrying branches and stones, and the farmers watch the "
    "banks. By midsummer it is slow and clear, and children swim in the deep pools below the old mill. The mill has "
    "not turned for a hundred years, but its wheel is still there, green with moss, and every visitor stops to look "
    "at it. In autumn the salmon come up from the sea to lay their eggs in the gravel beds, and for a few weeks the "
    "bridges are crowded with people who have come to see them leap the weir. Then the rains return, the water rises "
    "again, and the valley settles into another long winter of short days and cold nights."
)
TINY_TEXT = TEXT[: TEXT.index("By midsummer")].strip()  # 118 tokens of the tiny tokenizer: fits max_model_len 128
TINY_LOGIT_BOUND = 0.15
SMOLLM2_NLL_BOUND = 0.02  # nats per token: perplexity within a factor exp(0.02) = 1.020


@contextmanager
def _scale_read_10_percent_large() -> Iterator[None]:
    """A broken int8 cache: every read of the prefill context dequantizes with its scale 10% too large."""
    dequantize_slots = int8_kv.dequantize_slots

    def broken(data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_slots(data, scales * 1.1, slots, dtype)

    int8_kv.dequantize_slots = broken
    try:
        yield
    finally:
        int8_kv.dequantize_slots = dequantize_slots


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


def test_int8_logits_through_the_cache_stay_near_the_unquantized_ones(tiny_checkpoint) -> None:
    def logits(**overrides: object) -> torch.Tensor:
        engine = make_engine(tiny_checkpoint, max_num_batched_tokens=3, **overrides)
        result, _ = prompt_logits(engine, TINY_TEXT)
        assert engine.block_pool.num_used_blocks == 0
        if overrides:
            assert engine.attention_backend_name == "torch-int8"
        return result

    reference = logits()
    max_diff = (logits(kv_cache_dtype="int8") - reference).abs().max().item()
    assert 0 < max_diff < TINY_LOGIT_BOUND  # > 0: the cache really was quantized
    with _scale_read_10_percent_large():  # the bound catches a broken cache
        assert (logits(kv_cache_dtype="int8") - reference).abs().max().item() > 2 * TINY_LOGIT_BOUND


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
    sink = ReservationSink(layout, torch.device("cpu"))
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
def test_int8_perplexity_through_the_cache_on_smollm2(smollm2_checkpoint) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def nll(**overrides: object) -> float:
        """Mean negative log-likelihood per token of TEXT, through the cache in chunks of 8 tokens."""
        config = EngineConfig(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=8,  # type: ignore[arg-type]
                              **overrides)
        engine = LLMEngine(config, smollm2_checkpoint)
        logits, targets = prompt_logits(engine, TEXT)
        assert engine.block_pool.num_used_blocks == 0
        return torch.nn.functional.cross_entropy(logits, targets).item()

    reference = nll()
    assert reference < 4.0  # SmolLM2 reads the text as English (3.43 nats; a uniform guess is ln 49152 = 10.8)
    int8 = nll(kv_cache_dtype="int8")
    assert 0 < abs(int8 - reference) < SMOLLM2_NLL_BOUND  # != 0: the cache really was quantized
    with _scale_read_10_percent_large():  # the bound catches a broken cache
        assert nll(kv_cache_dtype="int8") - reference > 2 * SMOLLM2_NLL_BOUND
