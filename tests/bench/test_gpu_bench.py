"""bench/gpu.py end to end on the CPU, in its smoke mode: every figure the GPU run reports comes out, finite and
positive, in the JSON. Two tiny dummy shapes (a Llama with llama3 RoPE scaling, a Qwen2 with q/k/v biases) stand in
for the real ones so that the real engine and HF `generate` run in seconds; they cover both of the script's HF
config branches, which the GPU run (one shot, paid by the minute) must not be the first to exercise."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from engine.loader import dummy_weights
from engine.model.config import ModelConfig, RopeScaling

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"

TINY_SHAPES = {
    "tiny-llama": ModelConfig(
        architecture="llama", name="tiny-llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(511,),
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16),
    ),
    "tiny-qwen2": ModelConfig(
        architecture="qwen2", name="tiny-qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, attention_bias=True, bos_token_id=510,
        eos_token_ids=(511,),
    ),
}
DECODE_KEYS = ("step_ms", "step_ms_min", "steady_step_ms", "steady_over_floor", "floor_ms", "step_over_floor",
               "bytes_read_per_step", "achieved_gb_s",
               "pct_of_copy_bandwidth", "tokens_per_s")
PREFILL_KEYS = ("tokens", "seconds", "tokens_per_s", "flops", "floor_s", "tokens_per_s_floor", "pct_of_floor")
HF_KEYS = ("hf_tokens_per_s", "ours_tokens_per_s", "ours_over_hf")


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numbers(value, path="report"):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "args":  # the command line, echoed
                yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")


def test_smoke_run_reports_every_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for name, config in TINY_SHAPES.items():
        monkeypatch.setitem(dummy_weights.DUMMY_SHAPES, name, config)
    out = tmp_path / "gpu.json"
    status = _load_script().main([
        "--device", "cpu", "--shapes", ",".join(TINY_SHAPES), "--batches", "1,3", "--context", "40", "--steps", "3",
        "--warmup-steps", "1", "--prefill-prompts", "2", "--hf-batch", "2", "--hf-prompt-len", "8",
        "--hf-new-tokens", "4", "--copy-mib", "8", "--gemm-n", "128", "--json", str(out),
    ])
    assert status == 0, capsys.readouterr().out[-3000:]
    report = json.loads(out.read_text())

    assert report["device"].startswith("cpu") and report["dtype"] == "float32" and report["torch"]
    assert report["cuda_graphs"] is False
    for key in ("copy_bandwidth_gb_s", "gemm_tflops", "total_s"):
        assert key in report
    assert list(report["shapes"]) == list(TINY_SHAPES)
    for name, shape in report["shapes"].items():
        assert "errors" not in shape, shape["errors"]
        config = TINY_SHAPES[name]
        assert shape["kv_bytes_per_token"] == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
        # --async-scheduling both (the default): decode on an engine with it, then on one without.
        assert [(row["batch"], row["async_scheduling"]) for row in shape["decode"]] == [
            (1, True), (3, True), (1, False), (3, False)]
        assert [row["batch"] for row in shape["async_vs_sync"]] == [1, 3]
        assert all(row["off_over_on"] > 0 for row in shape["async_vs_sync"])
        # Kernels a step are counted at batch 1 (the default), on the first engine, where the profiler can: on cpu
        # the row says why not.
        assert [row["kernels"] for row in shape["decode"]] == [
            {"unavailable": "kernel counts need CUDA activity; the device is cpu"}, None, None, None]
        for row in shape["decode"]:
            assert all(key in row for key in DECODE_KEYS)
            # The floor counts the weights and each request's KV: 40 prompt tokens and the ones generated so far.
            kv_bytes = row["bytes_read_per_step"] - shape["weight_bytes"]
            per_request = kv_bytes / shape["kv_bytes_per_token"] / row["batch"]
            assert 40 < per_request < 40 + 60
        assert all(key in shape["prefill"] for key in PREFILL_KEYS)
        assert shape["prefill"]["tokens"] == 2 * 40
        assert all(key in shape["hf"] for key in HF_KEYS)
    numbers = list(_numbers(report))
    assert len(numbers) > 40
    bad = [(path, value) for path, value in numbers if not (math.isfinite(value) and value > 0)]
    assert not bad, bad
    assert "| tiny-llama | 3 x 40 |" in capsys.readouterr().out  # the summary table for docs/benchmarks.md


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_hf_side_is_the_same_model(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF model the script builds from a shape's config and dummy weights is the engine's model: the same
    greedy tokens and the same top-5 logprobs at every step (float32), so the ratio compares two runs of one model.
    This is what checks the HF config the script derives (RoPE scaling, Qwen2's biases, tied or not)."""
    import torch

    from engine.request.sampling_params import SamplingParams

    monkeypatch.setitem(dummy_weights.DUMMY_SHAPES, shape, TINY_SHAPES[shape])
    # Weights 10x the models' init scale: at 0.02 attention is near-uniform and positions barely matter, so a wrong
    # RoPE would go unseen.
    monkeypatch.setattr(dummy_weights, "INIT_STD", 0.2)
    gpu = _load_script()
    args = gpu.parse_args(["--device", "cpu", "--batches", "1", "--context", "16", "--hf-batch", "2",
                           "--hf-prompt-len", "12", "--hf-new-tokens", "12", "--prefill-prompts", "1"])
    cpu, config = torch.device("cpu"), TINY_SHAPES[shape]
    engine = gpu.build_engine(shape, cpu, "float32", args)
    prompts = gpu.random_prompts(2, 12, config.vocab_size, seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"same-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                               logprobs=5))
    ours = {}
    while engine.has_unfinished_requests():
        ours |= {out.request_id: out for out in gpu.step_checked(engine) if out.finished}
    assert engine.block_pool.num_used_blocks == 0

    weights = dummy_weights.dummy_weights(config, dtype=torch.float32, device=cpu, seed=gpu.SEED)
    model = gpu.hf_model(config, weights, cpu, torch.float32)
    with torch.inference_mode():
        hf = model.generate(input_ids=torch.tensor(prompts), attention_mask=torch.ones(2, 12, dtype=torch.long),
                            max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    hf_logprobs = torch.stack(hf.logits, dim=1).float().log_softmax(-1)  # [B, new_tokens, vocab]
    for row in range(2):
        out = ours[f"same-{row}"]
        assert out.token_ids == hf.sequences[row, 12:].tolist()
        for step, entry in enumerate(out.logprobs):
            top_ids = [token for token, _ in entry.top]
            expected = hf_logprobs[row, step, top_ids]
            assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), expected, atol=1e-3), (row, step)


def test_a_failed_phase_keeps_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU run is one shot: a phase that raises is recorded, the other figures still come out, the exit is 1."""
    monkeypatch.setitem(dummy_weights.DUMMY_SHAPES, "tiny-llama", TINY_SHAPES["tiny-llama"])
    gpu = _load_script()

    def broken_hf_model(*args, **kwargs):
        raise RuntimeError("no HF here")

    monkeypatch.setattr(gpu, "hf_model", broken_hf_model)
    out = tmp_path / "gpu.json"
    status = gpu.main(["--device", "cpu", "--shapes", "tiny-llama", "--batches", "2", "--context", "24", "--steps", "2",
                       "--warmup-steps", "1", "--prefill-prompts", "1", "--hf-batch", "2", "--hf-prompt-len", "8",
                       "--hf-new-tokens", "2", "--copy-mib", "1", "--gemm-n", "64", "--async-scheduling", "off",
                       "--json", str(out)])
    assert status == 1
    shape = json.loads(out.read_text())["shapes"]["tiny-llama"]
    assert shape["errors"] == {"hf_generate": "RuntimeError: no HF here"}
    assert [(row["batch"], row["async_scheduling"]) for row in shape["decode"]] == [(2, False)]
    assert shape["prefill"]["tokens_per_s"] > 0
    assert "hf" not in shape


# -- --quantization (bench/gpu_quantized.py) -------------------------------------------------------------------------
def test_quantization_flag_parses_and_fp8_on_cpu_is_refused(capsys) -> None:
    gpu = _load_script()
    assert gpu.parse_args([]).quantization == "none"
    for method in ("int8", "gguf", "fp8"):
        assert gpu.parse_args(["--quantization", method]).quantization == method
    with pytest.raises(SystemExit):
        gpu.parse_args(["--quantization", "awq"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--quantization", "fp8", "--device", "cpu"])
    assert "fp8 needs cuda" in capsys.readouterr().err


def test_fp8_on_a_machine_without_a_gpu_is_refused_before_any_figure(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("--device auto resolves to the GPU here")
    gpu = _load_script()

    def measured(*args, **kwargs):
        raise AssertionError("nothing is measured before the quantization is checked")

    monkeypatch.setattr(gpu, "copy_bandwidth", measured)
    assert gpu.main(["--quantization", "fp8"]) == 2
    assert "fp8 needs cuda" in capsys.readouterr().out


def test_ratios_and_fp8_targets() -> None:
    from bench.gpu_quantized import ratios

    none = [{"batch": 1, "step_ms": 2.0, "tokens_per_s": 500.0}, {"batch": 256, "step_ms": 8.0, "tokens_per_s": 32000.0}]
    fp8 = [{"batch": 1, "step_ms": 1.1, "tokens_per_s": 909.0}, {"batch": 256, "step_ms": 7.0, "tokens_per_s": 36571.0}]
    rows = ratios(none, fp8, "fp8")
    assert [(r["batch"], round(r["step_ratio"], 3), r["met"]) for r in rows] == [(1, 0.55, True), (256, 0.875, False)]
    assert rows[1]["target"] == "tokens_per_s_ratio >= 1.3" and round(rows[1]["tokens_per_s_ratio"], 3) == 1.143
    assert [r["target"] for r in ratios(none, fp8, "int8")] == [None, None]  # targets are fp8's only
    assert ratios(none, [{"batch": 7, "step_ms": 1.0, "tokens_per_s": 7.0}], "fp8") == []  # no baseline: no row


def test_gguf_smoke_run_measures_both_in_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--quantization gguf on the CPU: the dummy weights' linear layers in Q4_1 blocks through the engine, each
    batch decoded with none and with gguf, and their ratios; no prefill or HF phase."""
    monkeypatch.setitem(dummy_weights.DUMMY_SHAPES, "tiny-llama", TINY_SHAPES["tiny-llama"])
    out = tmp_path / "q.json"
    status = _load_script().main([
        "--device", "cpu", "--shapes", "tiny-llama", "--batches", "1,3", "--context", "24", "--steps", "2",
        "--warmup-steps", "1", "--copy-mib", "1", "--gemm-n", "64", "--async-scheduling", "off",
        "--quantization", "gguf", "--json", str(out),
    ])
    assert status == 0, capsys.readouterr().out[-3000:]
    report = json.loads(out.read_text())
    assert report["quantization"] == "gguf"
    shape = report["shapes"]["tiny-llama"]
    assert "errors" not in shape and "prefill" not in shape and "hf" not in shape
    q = shape["quantized"]
    assert [row["batch"] for row in q["rows"]["none"]] == [row["batch"] for row in q["rows"]["gguf"]] == [1, 3]
    assert [r["batch"] for r in q["ratios"]] == [1, 3]
    # Q4_1 (5 bits a weight) layers and a Q8_0 head (8.5) against float32's 32
    assert 0.1 < q["weight_bytes_ratio"] < 0.35
    bad = [(path, value) for path, value in _numbers(q) if not (math.isfinite(value) and value > 0)]
    assert not bad, bad
    assert "| tiny-llama | 3 |" in capsys.readouterr().out  # the ratio table for docs/benchmarks.md
