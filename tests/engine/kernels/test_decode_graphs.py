"""The CUDA-graph decode path's inputs (engine/cuda_graphs.py): static buffers, bucket padding, the pinned-copy
layout. On CPU a "replay" runs the same bucket-sized step eagerly over the same static buffers, under the Triton
interpreter (the engine's own CPU stand-in, cuda_graphs._EagerReplay), so everything but the capture itself is
checked here: padding rows (slot -1, length 0) must write no block and read none, and a graph step must give the
eager step's tokens. On a GPU the real capture is checked against --enforce-eager (gpu-marked tests below)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from engine import SamplingParams
from engine.cuda_graphs import DecodeGraphs
from tests.engine.tiny_model import TINY_ENGINE

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a b c d e f g",
           "Serving language models needs careful scheduling", "one", "two three"]


def captured(runner, *, max_seq_len: int, sizes: list[int],  # noqa: ANN001
             block_size: int | None = None) -> DecodeGraphs:
    """Decode graphs over the runner's model and cache, "captured" on CPU: the engine's stand-in there
    (cuda_graphs._EagerReplay) runs each bucket's step eagerly over the same static buffers."""
    graphs = DecodeGraphs(runner.model, runner.kv_caches, block_size=block_size or runner.block_size,
                          max_seq_len=max_seq_len, sizes=sizes)
    graphs.capture()
    return graphs


def _llm(model_dir: Path, device: str, **engine: object):
    from engine.llm import LLM

    return LLM(model=str(model_dir), **{**TINY_ENGINE, "device": device, "attention_backend": "triton", **engine})


def test_default_capture_sizes_follow_max_num_seqs() -> None:
    from engine.cuda_graphs import default_capture_sizes

    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(4096)[-3:] == [496, 504, 512]


def test_graph_sizes_and_eager_flag_parse_and_validate() -> None:
    import argparse

    from engine.config import EngineConfig
    from engine.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--enforce-eager", "--cuda-graph-sizes", "1,2,8"]))
    assert config.enforce_eager and config.cuda_graph_sizes == (1, 2, 8)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-sizes", "0,4"])
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive"):
        EngineConfig(cuda_graph_sizes=[])
    assert EngineConfig(cuda_graph_sizes=[4, 1]).cuda_graph_sizes == (4, 1)  # a list (JSON, Ray) comes back a tuple


STATIC_BUFFER_PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir: Path, device) -> list[list[int]]:
    """PROMPTS' greedy tokens, every step eager (on CPU: the Triton kernels interpreted, so computed once)."""
    if device.type == "cuda":
        pytest.skip("on a GPU the real capture is tested (test_cuda_graph_replay_equals_eager)")
    eager = _llm(tiny_model_dir, "cpu", async_scheduling=False)
    return [o.token_ids for o in eager.generate(PROMPTS, STATIC_BUFFER_PARAMS)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_steps_through_the_static_buffers_equal_eager_steps(tiny_model_dir: Path, device, async_scheduling,
                                                                   eager_tokens, torch_single_thread) -> None:
    """Async scheduling: a replay's input ids are the step in flight's tokens, written into the static buffer on
    the device (`DecodeGraphs.run`'s feed)."""
    if device.type == "cuda":
        pytest.skip("on a GPU the real capture is tested (test_cuda_graph_replay_equals_eager)")
    params, expected = STATIC_BUFFER_PARAMS, eager_tokens

    llm = _llm(tiny_model_dir, "cpu", async_scheduling=async_scheduling)
    runner = llm.engine.runner
    # Buckets 1, 4, 8: six sequences decode in a bucket of 8 (two padding rows), and fewer as they finish.
    runner.graphs = captured(runner, max_seq_len=llm.engine.max_model_len, sizes=[1, 4, 8])
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == expected
    assert runner.graphs.num_replays >= params.max_tokens - 1  # every decode step went through the buffers
    assert llm.engine.block_pool.num_used_blocks == 0


def test_padding_rows_write_no_block_and_leave_the_real_rows_alone(tiny_model_dir: Path, device,
                                                                    torch_single_thread) -> None:
    if device.type == "cuda":
        pytest.skip("CPU stand-in only")
    runner = _llm(tiny_model_dir, "cpu").engine.runner
    kv = runner.kv_cache  # [layers, 2, blocks, block_size, Hkv, D]
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
    before = kv.clone()
    step = {"input_ids": [7], "positions": [5], "slots": [4 * 4 + 1], "block_tables": [[3, 4]]}  # block 4, offset 1
    padded = captured(runner, block_size=4, max_seq_len=128, sizes=[8])  # its capture's step writes nothing either
    logits = padded.run(**step).clone()  # one real row, seven padding rows
    changed = (kv != before).flatten(4).any(-1)  # [layers, 2, blocks, block_size]
    assert changed.nonzero()[:, 2:].unique(dim=0).tolist() == [[4, 1]]  # only the real token's slot was written
    kv.copy_(before)
    alone = captured(runner, block_size=4, max_seq_len=128, sizes=[1]).run(**step)
    torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4)  # padding changed nothing the real row read


def test_a_step_larger_than_every_bucket_runs_eagerly(tiny_model_dir: Path, device, torch_single_thread) -> None:
    if device.type == "cuda":
        pytest.skip("CPU stand-in only")
    llm = _llm(tiny_model_dir, "cpu")
    runner = llm.engine.runner
    runner.graphs = captured(runner, max_seq_len=llm.engine.max_model_len, sizes=[2])
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], params)  # three decodes a step: larger than the one bucket
    assert [len(o.token_ids) for o in outs] == [3, 3, 3]
    assert runner.graphs.num_replays == 0
    assert llm.engine.block_pool.num_used_blocks == 0


def test_a_context_longer_than_the_graphs_runs_eagerly(tiny_model_dir: Path, device, torch_single_thread) -> None:
    if device.type == "cuda":
        pytest.skip("CPU stand-in only")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 9 tokens: decodes at positions 9..13
    expected = _llm(tiny_model_dir, "cpu").generate([prompt], params)[0].token_ids
    llm = _llm(tiny_model_dir, "cpu")
    runner = llm.engine.runner
    runner.graphs = captured(runner, block_size=4, max_seq_len=12, sizes=[1])
    assert llm.generate([prompt], params)[0].token_ids == expected
    assert runner.graphs.num_replays == 3  # positions 9, 10, 11 replayed; 12 and 13 (contexts > 12) ran eagerly
    assert llm.engine.block_pool.num_used_blocks == 0


# -- on a GPU: the real capture --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(tiny_model_dir: Path, dtype: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager = _llm(tiny_model_dir, "cuda", dtype=dtype, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]
    llm = _llm(tiny_model_dir, "cuda", dtype=dtype, cuda_graph_sizes=[1, 2, 4, 8])
    assert llm.engine.cuda_graph_capture_seconds is not None
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == expected
    assert llm.engine.runner.graphs.num_replays >= params.max_tokens - 1
    assert llm.engine.block_pool.num_used_blocks == 0


@pytest.mark.gpu
def test_cuda_graphs_sample_and_stream_like_eager_with_mixed_params(tiny_model_dir: Path) -> None:
    """Seeded random rows, logprobs and penalties over graph-computed logits: the same tokens as eager."""
    rows = [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=8, ignore_eos=True)]
    outs = {}
    for eager in (True, False):
        llm = _llm(tiny_model_dir, "cuda", dtype="float32", enforce_eager=eager)
        got = llm.generate(PROMPTS[:3], rows)
        outs[eager] = [o.token_ids for o in got]
        assert llm.engine.block_pool.num_used_blocks == 0
    assert outs[False] == outs[True]
