"""The engine's device: "auto" resolves to what the machine has, dtype "auto" follows it, `--device cuda` without a
GPU fails at once with one clear line (CLI) or a DeviceUnavailableError (LLM), and on a GPU (tests marked `gpu`,
skipped without one) the engine's float32 greedy output equals the CPU engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deploy.cli import main
from engine import SamplingParams
from engine.config import EngineConfig
from engine.device import DeviceUnavailableError, resolve_engine_config
from tests.engine.tiny_model import PROMPTS, TINY_ENGINE

HAS_CUDA = torch.cuda.is_available()
no_gpu_here = pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour of a machine without a CUDA GPU")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitserve: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_auto_resolves_to_what_the_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = resolve_engine_config(EngineConfig())
    assert (cpu.device, cpu.dtype) == ("cpu", "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = resolve_engine_config(EngineConfig())
    assert (gpu.device, gpu.dtype) == ("cuda", "bfloat16")
    assert resolve_engine_config(EngineConfig(dtype="float32")).dtype == "float32"  # a named dtype is kept
    assert resolve_engine_config(gpu) == gpu  # idempotent


def test_bad_device_names_are_refused() -> None:
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="fp8 needs a CUDA device"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8")


@no_gpu_here
def test_cuda_without_a_gpu_fails_before_loading_anything_in_LLM() -> None:
    from engine.llm import LLM

    # "not-loaded" names no model: reaching the loader would raise a different error.
    with pytest.raises(DeviceUnavailableError, match="--device cuda: no CUDA GPU is visible to this process"):
        LLM(model="not-loaded", device="cuda")


@no_gpu_here
@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--device", "cuda:1", "--dtype", "bfloat16"],
                                   ["--kv-cache-dtype", "fp8"]], ids=["cuda", "cuda:1", "fp8-on-auto"])
def test_cuda_without_a_gpu_is_one_error_line_from_generate(capsys: pytest.CaptureFixture[str],
                                                            flags: list[str]) -> None:
    rc = main(["generate", "--model", "not-loaded", "--prompt", "hi", *flags])

    assert rc == 2
    line = _one_error_line(capsys)
    assert "CUDA" in line and "not-loaded" not in line, line


@no_gpu_here
def test_cuda_without_a_gpu_is_one_error_line_from_serve(capsys: pytest.CaptureFixture[str],
                                                         tiny_model_dir: Path) -> None:
    rc = main(["serve", "--model", str(tiny_model_dir), "--device", "cuda", "--no-prefix-index"])

    assert rc == 2
    assert "--device cuda: no CUDA GPU is visible" in _one_error_line(capsys)


def test_the_engine_runs_where_its_config_says(tiny_model_dir: Path, torch_single_thread) -> None:
    from engine.llm import LLM

    llm = LLM(model=str(tiny_model_dir), **TINY_ENGINE)  # device and dtype "auto"
    engine = llm.engine
    expected = "cuda" if HAS_CUDA else "cpu"
    assert (engine.config.device, engine.device.type) == (expected, expected)
    assert engine.runner.kv_cache.device.type == expected
    assert engine.runner.model.embed.device.type == expected
    # dtype "auto" on cpu is float32, so a CPU engine's block hashes keep the namespace they had before the flag
    assert engine.hash_namespace.kv_dtype == ("bfloat16" if HAS_CUDA else "float32")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [8] * len(PROMPTS)
    assert engine.block_pool.num_used_blocks == 0


# -- on a GPU ------------------------------------------------------------------------------------------------------


def _greedy(model_dir: Path, **engine: object) -> tuple[list[list[int]], int]:
    from engine.llm import LLM

    llm = LLM(model=str(model_dir), **{**TINY_ENGINE, **engine})  # type: ignore[arg-type]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return [o.token_ids for o in outs], llm.engine.block_pool.num_used_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_float32_greedy_equals_the_cpu_engine(tiny_model_dir: Path, backend: str) -> None:
    cpu, _ = _greedy(tiny_model_dir, device="cpu", dtype="float32", attention_backend="torch")
    gpu, num_used = _greedy(tiny_model_dir, device="cuda", dtype="float32", attention_backend=backend)
    assert gpu == cpu
    assert num_used == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_float32_greedy_equals_the_cpu_engine_on_smollm2(smollm2_gguf: str) -> None:
    from engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=smollm2_gguf, device=device, dtype="float32", max_model_len=512, num_kv_blocks=256)
        outs[device] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.block_pool.num_used_blocks == 0
    assert outs["cuda"] == outs["cpu"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-1.5b"])
def test_dummy_shapes_run_on_cuda_in_bfloat16(shape: str) -> None:
    from engine.llm import LLM

    llm = LLM(model=shape, load_format="dummy", device="cuda", max_model_len=256, num_kv_blocks=64)
    assert llm.engine.config.dtype == "bfloat16" and llm.engine.attention_backend_name == "triton"
    outs = llm.generate(["Hello there", "a b c"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert llm.engine.block_pool.num_used_blocks == 0


@pytest.mark.gpu
def test_fp8_kv_cache_runs_on_cuda_and_frees_its_blocks(tiny_model_dir: Path) -> None:
    tokens, num_used = _greedy(tiny_model_dir, device="cuda", kv_cache_dtype="fp8")
    assert [len(t) for t in tokens] == [16] * len(PROMPTS)
    assert num_used == 0


def test_the_torch_free_cuda_probe_of_serve_counts_what_torch_counts() -> None:
    from deploy.cuda_probe import cuda_device_count

    assert cuda_device_count() == torch.cuda.device_count()


def test_a_checkpoint_loaded_in_another_dtype_is_cast_to_the_engines(tiny_checkpoint) -> None:
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(dtype="bfloat16", **TINY_ENGINE), tiny_checkpoint)  # type: ignore[arg-type]

    assert engine.runner.model.dtype == torch.bfloat16 and engine.runner.kv_cache.dtype == torch.bfloat16
    assert tiny_checkpoint.weights["model.embed_tokens.weight"].dtype == torch.float32  # the shared one untouched
