"""LoRA adapters in the engine (engine/lora/): a request under an adapter computes what the base model with that
adapter merged into its weights computes, in a batch mixing adapters and the base model; its KV blocks never
serve another adapter's prompt; --max-loras holds; every path gives its blocks back."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest

from engine.lora.adapter import LoRAError
from engine.request.lora import LoRAModule, LoRARequest
from tests.engine.lora.peft_adapter import make_adapter, merged
from tests.engine.tiny_model import (PROMPTS, TINY_DIMS, assert_no_blocks_held, drain, finals, greedy,
                                     make_engine)

LAYERS = TINY_DIMS["num_hidden_layers"]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = tiny_checkpoint.weights
    return {
        "all": make_adapter(root / "all", base, LAYERS, seed=1),  # every projection
        "qv": make_adapter(root / "qv", base, LAYERS, targets=("q_proj", "v_proj"), rank=2, alpha=4, seed=2),
        "mlp": make_adapter(root / "mlp", base, LAYERS, targets=("gate_proj", "down_proj"), rank=8, seed=3),
    }


def lora_engine(checkpoint, adapters, **overrides):
    modules = tuple((name, str(path)) for name, path in adapters.items())
    return make_engine(checkpoint, **{"enable_lora": True, "lora_modules": modules, "max_loras": 4, **overrides})


def run(engine, jobs: list[tuple[str, str | None]], max_tokens: int = 10) -> dict[str, list[int]]:
    """Each (prompt, adapter) as one request, all queued together; request id -> its tokens."""
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens, logprobs=1), lora_name=lora)
    outs = finals(drain(engine))
    assert_no_blocks_held(engine)
    return {rid: out.token_ids for rid, out in outs.items()}


def test_each_request_computes_its_adapter_merged_in_a_mixed_batch(tiny_checkpoint, adapters, torch_single_thread):
    jobs = [(p, lora) for p in PROMPTS for lora in (None, "all", "qv", "mlp")]
    got = run(lora_engine(tiny_checkpoint, adapters), jobs)
    base = tiny_checkpoint.weights
    for name in (None, "all", "qv", "mlp"):
        weights = base if name is None else merged(base, adapters[name])
        reference = make_engine(dataclasses.replace(tiny_checkpoint, weights=weights))
        want = run(reference, [(p, None) for p in PROMPTS])
        for k, p in enumerate(PROMPTS):
            assert got[f"r{jobs.index((p, name))}"] == want[f"r{k}"], (name, p)
    # The adapters change what is generated (else the test above could not tell them apart).
    for name in ("all", "qv", "mlp"):
        assert any(got[f"r{jobs.index((p, name))}"] != got[f"r{jobs.index((p, None))}"] for p in PROMPTS), name


def test_an_adapters_blocks_serve_only_its_own_prompts(tiny_checkpoint, adapters, torch_single_thread):
    engine = lora_engine(tiny_checkpoint, adapters)
    prompt = PROMPTS[1] * 3  # several full blocks
    hits = {}
    for step, lora in enumerate([None, "all", "qv", "all", None]):
        engine.add_request(f"s{step}", prompt, greedy(2), lora_name=lora)
        hits[step] = finals(drain(engine))[f"s{step}"].stats.num_cached_tokens
    assert hits[0] == hits[1] == hits[2] == 0  # the base model's blocks, then adapter all's: no cross hits
    assert hits[3] > 0 and hits[4] > 0  # the same adapter (and the base model) hit their own
    assert_no_blocks_held(engine)


def test_max_loras_runs_at_most_that_many_adapters_at_once(tiny_checkpoint, adapters, torch_single_thread):
    engine = make_engine(tiny_checkpoint, enable_lora=True, max_loras=1,
                         lora_modules=tuple((n, str(p)) for n, p in adapters.items()))
    jobs = [(p, lora) for lora in ("all", "qv", None, "mlp") for p in PROMPTS[:2]]
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"m{i}", prompt, greedy(6), lora_name=lora)
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        running = {r.lora.name for r in engine.scheduler.running if r.lora is not None}
        assert len(running) <= 1, running
        seen |= running
    assert seen == {"all", "qv", "mlp"}
    assert_no_blocks_held(engine)


def test_max_loras_passes_over_a_request_of_one_adapter_too_many_not_the_whole_queue(tiny_checkpoint, adapters,
                                                                                      torch_single_thread):
    engine = make_engine(tiny_checkpoint, enable_lora=True, max_loras=1,
                         lora_modules=tuple((n, str(p)) for n, p in adapters.items()))
    order = ["all", "qv", None, "all", "qv", None]  # alternating adapters, as a busy server sees them
    for i, lora in enumerate(order):
        engine.add_request(f"q{i}", PROMPTS[i % 4], greedy(6), lora_name=lora)
    engine.step()
    running = sorted(r.request_id for r in engine.scheduler.running)
    assert running == ["q0", "q2", "q3", "q5"]  # qv's requests wait; those behind them do not
    assert [r.request_id for r in engine.scheduler.waiting] == ["q1", "q4"]  # in their order, at the front
    finals(drain(engine))
    assert_no_blocks_held(engine)


def test_speculation_and_preemption_keep_the_adapters_tokens(tiny_checkpoint, adapters, torch_single_thread):
    jobs = [(p, lora) for p in PROMPTS for lora in ("all", None, "qv")]
    want = run(lora_engine(tiny_checkpoint, adapters), jobs, max_tokens=16)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "policy": "fixed"}
    assert run(lora_engine(tiny_checkpoint, adapters, speculative_config=spec), jobs, max_tokens=16) == want
    tight = lora_engine(tiny_checkpoint, adapters, num_kv_blocks=32)  # preempts and recomputes
    assert run(tight, jobs, max_tokens=16) == want
    assert tight.scheduler.num_preemptions > 0


def test_llm_loads_a_lora_request_on_first_use(tiny_model_dir, tiny_checkpoint, adapters, torch_single_thread):
    from engine.llm import LLM
    from tests.engine.tiny_model import TINY_ENGINE

    want = run(lora_engine(tiny_checkpoint, adapters), [(PROMPTS[0], "qv")])["r0"]
    llm = LLM(model=str(tiny_model_dir), enable_lora=True, **TINY_ENGINE)  # type: ignore[arg-type]
    request = LoRARequest("qv", 1, str(adapters["qv"]))
    [out] = llm.generate(PROMPTS[0], greedy(10), lora_request=request)
    assert out.token_ids == want
    with pytest.raises(LoRAError, match="is loaded from"):
        llm.generate(PROMPTS[0], greedy(2), lora_request=LoRARequest("qv", 1, str(adapters["all"])))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(PROMPTS[0], greedy(2), lora_request=[request, None])


def test_an_unloaded_adapters_running_requests_finish(tiny_checkpoint, adapters, torch_single_thread):
    engine = lora_engine(tiny_checkpoint, adapters)
    want = run(lora_engine(tiny_checkpoint, adapters), [(PROMPTS[2], "mlp")])["r0"]
    engine.add_request("u", PROMPTS[2], greedy(10), lora_name="mlp")
    engine.step()
    engine.loras.unload("mlp")
    assert finals(drain(engine))["u"].token_ids == want
    with pytest.raises(LoRAError, match="no LoRA adapter named 'mlp' is loaded"):
        engine.add_request("v", PROMPTS[2], greedy(2), lora_name="mlp")
    assert_no_blocks_held(engine)


def test_requests_naming_no_loaded_adapter_are_refused_before_any_block(tiny_checkpoint, adapters):
    engine = lora_engine(tiny_checkpoint, adapters)
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'nope' is loaded \(loaded: all, mlp, qv\)"):
        engine.add_request("x", PROMPTS[0], greedy(2), lora_name="nope")
    plain = make_engine(tiny_checkpoint)
    with pytest.raises(ValueError, match="serves none"):
        plain.add_request("x", PROMPTS[0], greedy(2), lora_name="all")
    assert_no_blocks_held(engine)
    assert_no_blocks_held(plain)


def test_engine_config_rules(tiny_checkpoint, adapters):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        EngineConfig(lora_modules=(("a", "/x"),))
    with pytest.raises(ValueError, match="max_loras must be positive"):
        EngineConfig(enable_lora=True, max_loras=0)
    with pytest.raises(LoRAError, match="rank 8, above --max-lora-rank 4"):
        make_engine(tiny_checkpoint, enable_lora=True, max_lora_rank=4, lora_modules=(("mlp", str(adapters["mlp"])),))


@pytest.mark.parametrize("text, want", [
    ("sql=/a/b", LoRAModule("sql", "/a/b")),
    ('{"name": "sql", "path": "/a/b", "base_model_name": "m"}', LoRAModule("sql", "/a/b")),
])
def test_lora_modules_entries(text, want):
    assert LoRAModule.parse(text) == want


@pytest.mark.parametrize("text, match", [
    ("/a/b", "NAME=PATH"), ("=/a/b", "1-256 printable"), (" x =/a", "surrounding spaces"),
    ('{"name": 3, "path": "/a"}', '"name" and "path" strings'), ("{nope", "not JSON"),
])
def test_bad_lora_modules_entries(text, match):
    with pytest.raises(ValueError, match=match):
        LoRAModule.parse(text)


def test_generate_command_runs_prompts_under_an_adapter(capsys, tiny_model_dir, tiny_checkpoint, adapters,
                                                        torch_single_thread):
    import json

    from deploy.cli import main
    from tests.engine.test_cli import TINY_FLAGS

    want = run(lora_engine(tiny_checkpoint, adapters), [(PROMPTS[1], "all")])["r0"]
    flags = ["generate", "--model", str(tiny_model_dir), *TINY_FLAGS, "--prompt", PROMPTS[1], "--max-tokens", "10",
             "--temperature", "0", "--ignore-eos", "--json", "--enable-lora", "--lora-modules",
             f"all={adapters['all']}"]
    assert main([*flags, "--lora-name", "all"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert main([*flags, "--lora-name", "other"]) == 2  # a usage error, before the model loads
    assert "--lora-name 'other' is not one of --lora-modules (all)" in capsys.readouterr().err


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_run_their_shards_of_each_adapter(tiny_checkpoint, adapters, tp, torch_single_thread):
    """TP 2 splits the tiny model's 4 query / 2 KV heads, TP 4 replicates its KV heads: each rank's shard of every
    adapter gives TP 1's tokens, in a mixed batch (runs grouped, row-parallel deltas before the all-reduce), for
    adapters loaded at start-up and at run time; an unloaded adapter's shards leave the children."""
    jobs = [(p, lora) for p in PROMPTS for lora in (None, "all", "qv", "mlp")]
    late = {"all": adapters["all"], "qv": adapters["qv"]}
    want = run(lora_engine(tiny_checkpoint, adapters), jobs)
    engine = lora_engine(tiny_checkpoint, late, tensor_parallel_size=tp, num_threads=1)
    try:
        engine.loras.load("mlp", str(adapters["mlp"]))  # at run time: its shards reach the children next step
        assert run(engine, jobs) == want
        shards = engine.runner.model.lora_shards
        engine.loras.unload("mlp")
        gc.collect()  # rank 0's shard goes once nothing holds it; its children's at the next step
        assert len(shards._gone) == 1  # its children's shards go before the next step
        assert run(engine, [(PROMPTS[0], "all")]) == {"r0": want[f"r{jobs.index((PROMPTS[0], 'all'))}"]}
        assert not shards._gone and not shards._loads
    finally:
        engine.close()


def test_a_worker_refuses_a_request_for_another_adapter_under_the_same_name(tiny_checkpoint, adapters):
    from protos import serving_pb2
    from worker.runtime import check_adapter

    engine = lora_engine(tiny_checkpoint, adapters)
    request = engine.make_request("w", PROMPTS[0], greedy(2), lora_name="all")
    digest = engine.loras.get("all").digest
    check_adapter(request, serving_pb2.GenerateRequest(lora_name="all", lora_digest=digest))
    check_adapter(request, serving_pb2.GenerateRequest(lora_name="all"))  # no digest: not checked
    with pytest.raises(LoRAError, match="loaded again since"):
        check_adapter(request, serving_pb2.GenerateRequest(lora_name="all", lora_digest="sha256:other"))
    assert_no_blocks_held(engine)  # made, never queued


def test_max_cpu_loras_keeps_the_most_recent_in_memory_and_reads_the_others_again(tiny_checkpoint, adapters,
                                                                                  tmp_path, torch_single_thread):
    import shutil

    want = run(lora_engine(tiny_checkpoint, adapters), [(PROMPTS[0], lora) for lora in ("all", "qv", "mlp")])
    engine = lora_engine(tiny_checkpoint, adapters, max_loras=1, max_cpu_loras=1)
    loras = engine.loras
    assert loras.num_loads == 3 and [loras.resident(n) for n in ("all", "qv", "mlp")] == [False, False, True]
    for i, lora in enumerate(("all", "qv", "mlp")):  # with room for one, each is read again, and exact
        assert run(engine, [(PROMPTS[0], lora)]) == {"r0": want[f"r{i}"]}
    assert loras.num_loads == 6 and loras.resident("mlp") and not loras.resident("all")
    copy = shutil.copytree(adapters["qv"], tmp_path / "qv-copy")
    loras.load("copy", str(copy))  # evicts mlp
    other = make_adapter(tmp_path / "qv-other", tiny_checkpoint.weights, LAYERS, targets=("q_proj", "v_proj"), rank=2,
                         alpha=4, seed=9)  # the same shapes, other values
    shutil.copy(other / "adapter_model.safetensors", copy / "adapter_model.safetensors")
    loras.get("mlp")  # evicts copy
    with pytest.raises(LoRAError, match="the files in .* changed since it was loaded"):
        engine.add_request("x", PROMPTS[0], greedy(2), lora_name="copy")
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        make_engine(tiny_checkpoint, enable_lora=True, max_loras=2, max_cpu_loras=1)
    assert_no_blocks_held(engine)


def test_a_request_passed_over_for_its_adapter_preempts_nobody(tiny_checkpoint, adapters, torch_single_thread):
    engine = lora_engine(tiny_checkpoint, adapters, max_loras=1, max_num_seqs=2, scheduling_policy="priority")
    for i in range(2):
        engine.add_request(f"low{i}", PROMPTS[i], greedy(8, priority=5), lora_name="all")
    engine.step()
    engine.add_request("high", PROMPTS[2], greedy(4, priority=0), lora_name="qv")  # outranks both, another adapter
    assert not engine.scheduler.priority_preemption_due()  # nothing it may take a place from: it waits its turn
    engine.step()
    assert sorted(r.request_id for r in engine.scheduler.running) == ["low0", "low1"]
    assert engine.scheduler.num_preemptions == 0
    finals(drain(engine))
    assert_no_blocks_held(engine)
