"""`splitserve profile`'s measuring functions on the tiny test model (tests/engine/tiny_model.py), and the command
itself end to end on it (the real SmolLM2 --quick takes ~85 s on 2 loaded cores: run by hand, docs/benchmarks.md).
Nothing here asserts a speed: only what was measured, that the engine is left with no request and no KV block in
use, and that the profile's curves fit its points."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.planner.fit import fit_nonnegative
from deploy.planner.profile import DecodeFit, PrefillFit, load_profile


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.tiny_model import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[object]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=128, max_model_len=128,
                                    max_num_seqs=8, seed=0))
    yield engine
    engine.close()


def test_a_prefill_measurement_runs_one_prompt_and_frees_its_blocks(engine) -> None:
    from deploy.planner.profiler import measure_prefill

    rng = random.Random(0)
    queries_before = engine.kv_cache.prefix_queries_tokens
    hits_before = engine.kv_cache.prefix_hits_tokens
    assert measure_prefill(engine, 24, 0, rng) > 0
    assert measure_prefill(engine, 8, 32, rng) > 0  # 32 cached: its prefix ran first, then hit
    assert engine.kv_cache.prefix_hits_tokens - hits_before == 32
    assert engine.kv_cache.prefix_queries_tokens > queries_before
    assert engine.block_pool.num_used_blocks == 0 and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="a cached prefix is whole blocks: 6 is not a multiple of 4"):
        measure_prefill(engine, 8, 6, rng)


def test_a_decode_measurement_times_steps_of_the_whole_batch_and_frees_its_blocks(engine) -> None:
    from deploy.planner.profiler import measure_decode

    rng = random.Random(1)
    generated_before = engine.outputs.num_generation_tokens
    assert measure_decode(engine, 4, 40, 3, rng) > 0
    # 4 sequences x (3 timed steps + 2) tokens, and the warm-up's 1
    assert engine.outputs.num_generation_tokens - generated_before == 4 * 5 + 1
    assert engine.block_pool.num_used_blocks == 0 and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="a batch of 9 needs --max-num-seqs >= 9"):
        measure_decode(engine, 9, 40, 3, rng)


def test_the_fits_recover_known_curves() -> None:
    prefill = PrefillFit(intercept_s=0.02, per_token_s=0.0004, per_token_context_s=2e-7)
    points = [(n, c) for n in (16, 64, 256, 1024) for c in (0, 512)]
    fitted = PrefillFit.of(*fit_nonnegative([PrefillFit.features(n, c) for n, c in points],
                                            [prefill.seconds(n, c) for n, c in points]))
    assert fitted.intercept_s == pytest.approx(0.02, rel=1e-6)
    assert fitted.per_token_s == pytest.approx(0.0004, rel=1e-6)
    assert fitted.per_token_context_s == pytest.approx(2e-7, rel=1e-6)
    # a curve whose best unconstrained fit has a negative term gets that term at 0, the rest still fitting
    decode = [(1, 128, 0.020), (8, 128, 0.019), (32, 128, 0.030), (8, 1024, 0.026)]
    coefficients = fit_nonnegative([DecodeFit.features(b, c) for b, c, _ in decode], [t for _, _, t in decode])
    assert min(coefficients) >= 0
    with pytest.raises(ValueError, match="no points"):
        fit_nonnegative([], [])


@pytest.mark.slow  # the engine over the tiny model, and bench/handoff_cost.py's inproc handoffs in a subprocess
def test_splitserve_profile_quick_writes_a_profile_plan_reads(tiny_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.cli import main

    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_dir), "--quick", "--num-kv-blocks", "512", "--transports", "inproc",
                 "--serving-requests", "0", "--out", str(out), "--seed", "0", "--tensor-parallel-sizes", "2"]) == 0
    err = capsys.readouterr().err
    assert "profile: " in err and "decode batch 8 at 256 tokens" in err  # the progress bar named its points
    profile = load_profile(out)
    data = json.loads(out.read_text())
    # The tiny model's 512-token context keeps the quick grid's points below it: prefill 32 and 256, decode at 256.
    assert [(p.num_new_tokens, p.num_cached_tokens) for p in profile.prefill_points] == [(32, 0), (256, 0)]
    assert [(p.batch_size, p.context_len) for p in profile.decode_points] == [(1, 256), (8, 256), (32, 256)]
    assert set(profile.handoff) == {"inproc"} and len(profile.handoff["inproc"].points) == 2
    assert [p.num_bytes for p in profile.handoff["inproc"].points] == [256 * 46080, 1024 * 46080]  # SmolLM2's KV
    assert profile.kv.num_blocks == 512 and profile.kv.block_size == 16
    assert profile.model.name == str(tiny_dir) and profile.model.identity.startswith("sha256:")
    assert profile.engine["max_num_seqs"] == 128 and profile.machine["cpu_count"] >= 1
    assert data["versions"]["torch"] and data["machine"]["num_threads"] >= 1
    # on more than one thread, the one-thread cost of each phase was measured too
    assert set(profile.one_thread) == ({"prefill", "decode"} if data["machine"]["num_threads"] > 1 else set())
    assert all(ratio > 0 for ratio in profile.one_thread.values())
    # each phase's slowdown beside the quick grid's busy cores (a real measurement: no speed asserted), no serve
    assert {phase: [p.background_cores for p in points] for phase, points in profile.contention.items()} == {
        "prefill": [0.5, 1.0], "decode": [0.5, 1.0]}
    assert all(p.slowdown > 0 for points in profile.contention.values() for p in points)
    assert profile.serving is None and data["serving"] is None
    assert profile.loaded is None and data["loaded"] is None  # --quick: no loaded probe
    # size 2 (the tiny model's 2 KV heads, one a rank) on the same threads split between its ranks
    assert set(profile.tensor_parallel) == {2}
    scale = profile.tensor_parallel[2]
    assert scale.prefill > 0 and scale.decode > 0
    assert scale.threads_per_rank == max(1, data["machine"]["num_threads"] // 2)
    assert "TP 2: prefill x" in err
    for p in profile.prefill_points:
        assert profile.prefill.seconds(p.num_new_tokens, p.num_cached_tokens) > 0
    # plan reads it: a loose SLO for the tiny model is met (exit 0); the flags name the tiny model's directory
    assert main(["plan", "--profile", str(out), "--isl", "128", "--osl", "16", "--rate", "1", "--ttft-slo", "30",
                 "--tpot-slo", "5", "--max-workers", "2"]) == 0
    assert f"--model {tiny_dir}" in capsys.readouterr().out
    # with room for a worker of size 2, the search prices pools at that size too
    assert main(["plan", "--profile", str(out), "--isl", "128", "--osl", "16", "--rate", "1", "--ttft-slo", "30",
                 "--tpot-slo", "5", "--max-workers", "4", "--json", "--top", "1000"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert {(r["layout"]["tp"], r["layout"]["prefill_tp"], r["layout"]["decode_tp"]) for r in ranked} >= {
        (2, 1, 1), (1, 2, 1), (1, 1, 2)}


@pytest.mark.parametrize("flags, match", [(["--loaded-rates", "1,-2"], "--loaded-rates: positive"),
                                          (["--loaded-rates", "one"], "--loaded-rates: comma-separated"),
                                          (["--loaded-requests", "-1"], "--loaded-requests must be >= 0"),
                                          (["--tensor-parallel-sizes", "1"], "each size >= 2"),
                                          (["--tensor-parallel-sizes", "3"], "tensor_parallel_size 3 does not divide")])
def test_bad_loaded_probe_flags_are_clear_errors_before_any_measuring(tiny_dir: Path, tmp_path: Path, flags: list[str],
                                                                     match: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.cli import main

    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_dir), "--out", str(out), *flags]) == 2
    assert match in capsys.readouterr().err and not out.exists()


@pytest.mark.slow  # the real SmolLM2, a real gRPC receiver process and a real serve (one colocated worker)
def test_splitserve_profile_quick_on_the_real_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.cli import main

    out = tmp_path / "profile.json"
    # One thread, as every serve in this suite runs its workers (tests/deploy/processes.py): two threads beside the
    # other xdist worker's test wait at OpenMP barriers, which made this test 2x slower in the suite than alone.
    assert main(["profile", "--model", "smollm2-135m", "--quick", "--transports", "grpc", "--num-threads", "1",
                 "--serving-requests", "3", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.model.name == "smollm2-135m" and profile.model.identity.startswith("sha256:")
    assert len(profile.prefill_points) == 4 and len(profile.decode_points) == 4
    # SmolLM2's float32 KV: 30 layers x K,V x 3 heads x 64 x 4 bytes = 46,080 bytes a token, 16-token blocks
    assert profile.kv.block_bytes == 16 * 46_080 and profile.kv.block_size == 16
    assert [p.num_bytes for p in profile.handoff["grpc"].points] == [256 * 46_080, 1024 * 46_080]
    # the fitted prefill grows with the prompt, and a cached prefix makes a prompt cheaper than computing it all
    assert profile.prefill.seconds(1024) > profile.prefill.seconds(256) > profile.prefill.seconds(32)
    assert profile.prefill.seconds(256, 768) < profile.prefill.seconds(1024)
    # a real serve of one colocated worker measured what serving adds (3 requests of each kind, 256-word prompts)
    assert profile.serving is not None and profile.serving.num_requests == 3
    assert profile.engine["num_threads"] == 1 and not profile.one_thread  # nothing to compare one thread with
    assert 200 <= profile.serving.prompt_tokens <= 600 and profile.serving.gateway_cpu_per_token_s >= 0
    capsys.readouterr()
    # An SLO that a profile measured on a loaded machine still meets: beside a busy core (the suite runs another
    # file at once) this one measured a TPOT p90 of 0.66 s for the best layout, and plan rightly said none met 0.5 s.
    assert main(["plan", "--profile", str(out), "--model", "smollm2-135m", "--isl", "256", "--osl", "64",
                 "--ttft-slo", "60", "--tpot-slo", "5", "--max-workers", "4"]) == 0
    assert "splitserve serve --model smollm2-135m" in capsys.readouterr().out
