"""A tensor-parallel engine (engine/distributed/) against the same engine at TP 1, with real rank processes.

Over the tiny model (4 query / 2 KV heads: TP 2 splits both, TP 4 replicates the KV heads and pads the vocabulary):
chunked prefill, prefix-cache hits, preemption, n > 1 (seeded sampling: the same draws need the same logits), an
int8 KV cache, ngram, draft-model and layer-skip speculation and prompt logprobs give TP 1's tokens, with every
logits row within 1e-3 and every block back in the pool; `LLM` and the flag take the size; each rank holds its share
of the weights; what does not run is refused before any rank starts; a killed rank fails the engine's requests with
an error naming it (no hang, blocks back), and the ranks die with the engine's process. The llama-3.2-1b shape (32 /
8 heads) runs at TP 2 and 4, cut to one layer and an 8k vocabulary to stay cheap. The collectives go through shared
memory; gloo's sockets, kept by an environment variable, answer the same. Real SmolLM2 at TP 3:
tests/engine/test_exactness.py.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.distributed.tp_sizes import TensorParallelSizeError
from tests.engine.distributed.tp_compare import SampledLogits, assert_tp_matches
from tests.engine.tiny_model import PROMPTS, BlockRefCounter, assert_no_blocks_held, drain, finals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# Small blocks, a small step budget (prompts prefill in chunks) and a pool too small for the whole workload at once
# (requests preempt each other), prefix caching on.
ENGINE = dict(block_size=4, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=6, num_threads=1)


Requests = dict[str, tuple[str | list[int], SamplingParams]]


def run(engine, requests: Requests) -> dict[str, list[int]]:  # noqa: ANN001
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    return {rid: out.token_ids for rid, out in finals(drain(engine)).items()}


def prompt_ids(engine, requests: Requests) -> dict[str, list[int]]:  # noqa: ANN001
    """Each request's (and each of its choices') prompt token ids."""
    ids = {}
    for request_id, (prompt, params) in requests.items():
        tokens = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids[request_id] = tokens
        for i in range(1, params.n):
            ids[f"{request_id}#{i}"] = tokens
    return ids


class Pair:
    """The same engine config at TP 1 and TP N, their sampled logits recorded, fed the same workloads."""

    def __init__(self, checkpoint, tp: int, **config: object) -> None:  # noqa: ANN001
        self.tp1 = make_engine(checkpoint, **config)
        self.tpn = make_engine(checkpoint, tensor_parallel_size=tp, **config)
        self.logits1, self.logitsn = SampledLogits.install(self.tp1), SampledLogits.install(self.tpn)

    def check(self, requests: Requests) -> dict[str, list[int]]:
        counters = BlockRefCounter(self.tp1), BlockRefCounter(self.tpn)
        want, got = run(self.tp1, requests), run(self.tpn, requests)
        assert_tp_matches(prompt_ids(self.tp1, requests), want, got, self.logits1, self.logitsn)
        for engine, counter in zip((self.tp1, self.tpn), counters, strict=True):
            assert_no_blocks_held(engine)
            counter.assert_balanced()
        return got

    def close(self) -> None:
        self.tpn.close()


@pytest.fixture(scope="module")
def tp2(tiny_checkpoint):  # noqa: ANN001, ANN201
    pair = Pair(tiny_checkpoint, 2, **ENGINE)
    yield pair
    pair.close()
    assert not pair.tpn.runner.model.ranks.processes[0].is_alive()


def test_chunked_prefill_and_prefix_hits_match_tp1(tp2: Pair) -> None:
    requests = {f"r{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS)}
    tp2.check(requests)
    hits = tp2.tpn.kv_cache.prefix_hits_tokens
    tp2.check({f"again{i}": (p + " and more", greedy(6)) for i, p in enumerate(PROMPTS)})  # prompts cached whole
    assert tp2.tpn.kv_cache.prefix_hits_tokens > hits
    assert max(len(ids) for ids in prompt_ids(tp2.tpn, requests).values()) > ENGINE["max_num_batched_tokens"]


def test_collectives_over_shared_memory_by_default_and_gloo_answers_the_same(tp2: Pair, tiny_checkpoint,  # noqa: ANN001
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The TP engine's all-reduces and logits gathers go through shared memory (engine/distributed/shm_collectives.py)
    on an x86-64 host; $SPLITSERVE_TP_CPU_COLLECTIVES=gloo keeps gloo's sockets, with the same tokens."""
    from engine.distributed import shm_collectives

    group = tp2.tpn.runner.model.group
    assert (group.shm is not None) == shm_collectives.supported()
    before = group.shm._seq if group.shm is not None else 0  # noqa: SLF001 - its operations so far
    requests = {f"r{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS)}
    want = tp2.check(requests)
    assert group.shm is None or group.shm._seq > before  # noqa: SLF001
    monkeypatch.setenv(shm_collectives.ENV, "gloo")
    gloo = make_engine(tiny_checkpoint, tensor_parallel_size=2, **ENGINE)
    try:
        assert gloo.runner.model.group.shm is None
        assert run(gloo, requests) == want
        assert_no_blocks_held(gloo)
    finally:
        gloo.close()


def test_preemption_matches_tp1(tp2: Pair) -> None:
    before = tp2.tpn.scheduler.num_preemptions
    tp2.check({f"long{i}": (p, greedy(24)) for i, p in enumerate(PROMPTS)})
    assert tp2.tpn.scheduler.num_preemptions > before
    assert tp2.tp1.scheduler.num_preemptions == tp2.tpn.scheduler.num_preemptions


def test_n_choices_match_tp1(tp2: Pair) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    got = tp2.check({"n": (PROMPTS[1], params), "g": (PROMPTS[2], greedy(4))})
    assert {"n", "n#1", "n#2", "g"} <= got.keys()
    assert len({tuple(got[c]) for c in ("n", "n#1", "n#2")}) > 1, "the three choices sampled alike"


def test_each_rank_holds_its_share_of_the_weights(tp2: Pair) -> None:
    from engine.distributed.rank_worker import model_weight_bytes

    whole = model_weight_bytes(tp2.tp1.runner.model)
    config = tp2.tp1.model_config
    replicated = (2 * config.num_layers + 1) * config.hidden_size * 4  # the RMSNorm weights, float32
    per_rank = tp2.tpn.runner.model.weight_bytes()
    assert len(per_rank) == 2
    for rank_bytes in per_rank:
        assert rank_bytes == pytest.approx((whole - replicated) / 2 + replicated, rel=0.02), (per_rank, whole)


def test_int8_kv_cache_matches_tp1(tiny_checkpoint) -> None:  # noqa: ANN001
    pair = Pair(tiny_checkpoint, 2, **ENGINE, kv_cache_dtype="int8")
    try:
        assert pair.tpn.runner.kv_scales is not None
        pair.check({f"r{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS)})
    finally:
        pair.close()


def test_replicated_kv_heads_and_a_padded_vocabulary_match_tp1(tiny_checkpoint) -> None:  # noqa: ANN001
    """TP 4 over 2 KV heads: each KV head on two ranks; a 702-token vocabulary in slices of 176, the last padded."""
    pair = Pair(tiny_checkpoint, 4, **ENGINE)
    try:
        assert pair.tpn.runner.kv_cache.shape[4] == 1
        assert pair.tpn.runner.model.local.lm_head.dense_weight().shape[0] * 4 > pair.tpn.model_config.vocab_size
        pair.check({f"r{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS)})
    finally:
        pair.close()


def test_ngram_speculation_and_prompt_logprobs_match_tp1(tiny_checkpoint) -> None:  # noqa: ANN001
    """Drafts verified over the gathered logits, and prompt logprobs (several logits calls a step, each one the
    children follow). The fixed policy: the dynamic one prices drafts by measured step times, and on a loaded
    machine may decide none pays."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "policy": "fixed"}
    pair = Pair(tiny_checkpoint, 2, **{**ENGINE, "max_num_batched_tokens": 64}, speculative_config=spec)
    try:
        repeated = " ".join(["one two three four"] * 4)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
        pair.tp1.add_request("p", repeated, params)
        pair.tpn.add_request("p", repeated, params)
        outs1, outsn = drain(pair.tp1)["p"], drain(pair.tpn)["p"]
        assert outsn[-1].token_ids == outs1[-1].token_ids
        want, got = (next(o.prompt_logprobs for o in outs if o.prompt_logprobs) for outs in (outs1, outsn))
        assert len(got) == len(want) > 10
        assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in want]
        assert max(abs(a[1] - b[1]) for g, w in zip(got, want, strict=True)
                   for a, b in zip(g.top, w.top, strict=True)) < 1e-4
        assert pair.tpn.stats().spec_decode_num_accepted_tokens > 0, "no draft was accepted"
        assert_no_blocks_held(pair.tpn)
    finally:
        pair.close()


def test_a_draft_model_drafts_at_tp1_on_rank_0_and_matches_tp1(tiny_checkpoint) -> None:  # noqa: ANN001
    """draft_model at TP 2: the draft model (here the tiny model itself) runs whole on rank 0, its KV cache over
    the target's block ids; only the verification runs on every rank. Greedy: TP 1's tokens, every draft accepted
    (the target drafting for itself), every block back."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_checkpoint.path),
            "policy": "fixed"}
    pair = Pair(tiny_checkpoint, 2, **{**ENGINE, "max_num_batched_tokens": 64}, speculative_config=spec)
    try:
        assert pair.tpn.speculator.proposer.model.group.size == 1  # the draft model: not sharded
        pair.check({f"r{i}": (p, greedy(10)) for i, p in enumerate(PROMPTS)})
        stats = pair.tpn.stats()
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    finally:
        pair.close()


def test_structured_outputs_match_tp1(tiny_checkpoint) -> None:  # noqa: ANN001
    """Grammar masks apply to the logits gathered on rank 0: a JSON schema, a regex and a choice (greedy and
    seeded) give TP 1's tokens."""
    from tests.engine.structured.test_fill_ahead import PROMPTS as GRAMMAR_PROMPTS
    from tests.engine.structured.test_fill_ahead import batch_params

    pair = Pair(tiny_checkpoint, 2, **{**ENGINE, "num_kv_blocks": 64, "max_model_len": 128})
    try:
        pair.check({f"g{i}": (p, params) for i, (p, params) in enumerate(zip(GRAMMAR_PROMPTS, batch_params(),
                                                                             strict=True))})
    finally:
        pair.close()


def test_llm_and_the_generate_flag_take_the_size(tiny_model_dir: Path) -> None:
    import argparse

    from engine.engine_args import add_engine_args, engine_config_from_args
    from engine.llm import LLM
    from tests.engine.tiny_model import TINY_ENGINE

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--tensor-parallel-size", "2"])).tensor_parallel_size == 2
    outputs = {}
    for tp in (1, 2):
        llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=tp, num_threads=1,
                  **TINY_ENGINE)  # type: ignore[arg-type]
        try:
            outputs[tp] = [out.token_ids for out in llm.generate(PROMPTS, greedy(6))]
        finally:
            llm.engine.close()
    assert outputs[2] == outputs[1]


def test_a_layer_skip_draft_runs_every_ranks_first_layers_and_matches_tp1(tiny_checkpoint) -> None:  # noqa: ANN001
    """layer_skip at TP 2: the draft is every rank's first layer (its all-reduces meeting as the whole model's,
    its KV the target's own), then the gathered head. Greedy: TP 1's tokens and the same drafts accepted, every
    block back."""
    spec = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3, "policy": "fixed"}
    pair = Pair(tiny_checkpoint, 2, **{**ENGINE, "max_num_batched_tokens": 64}, speculative_config=spec)
    try:
        pair.check({f"r{i}": (p, greedy(10)) for i, p in enumerate(PROMPTS)})
        one, n = pair.tp1.stats(), pair.tpn.stats()
        assert n.spec_decode_num_draft_tokens == one.spec_decode_num_draft_tokens > 0
        assert n.spec_decode_num_accepted_tokens == one.spec_decode_num_accepted_tokens
    finally:
        pair.close()


def test_what_does_not_run_is_refused_before_any_rank_starts(tiny_checkpoint) -> None:  # noqa: ANN001
    running = set(multiprocessing.active_children())
    with pytest.raises(TensorParallelSizeError, match="4 query heads and 2 KV heads"):
        make_engine(tiny_checkpoint, tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == running


def test_a_killed_rank_fails_the_engine_cleanly(tiny_checkpoint) -> None:  # noqa: ANN001
    engine = make_engine(tiny_checkpoint, tensor_parallel_size=2, **ENGINE)
    ranks = engine.runner.model.ranks
    (child,) = ranks.processes
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, greedy(16))
        engine.step()
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        start_s = time.monotonic()
        outputs = drain(engine)
        finished = finals(outputs)
        assert time.monotonic() - start_s < 60, "the engine waited on the dead rank"
        assert {out.finish_reason for out in finished.values()} == {"error"}
        errors = {out.error for out in finished.values()}
        assert any(f"rank 1 (pid {child.pid}) was killed by signal 9" in (e or "") for e in errors), errors
        assert_no_blocks_held(engine)
        # The engine stays failed: a new request errors at once, naming the same rank.
        engine.add_request("later", PROMPTS[0], greedy(4))
        (later,) = drain(engine)["later"][-1:]
        assert later.finish_reason == "error" and "rank 1" in later.error
        assert_no_blocks_held(engine)
    finally:
        engine.close()
    assert not child.is_alive()


_RANK_0 = textwrap.dedent("""
    import sys, time
    import engine.distributed.rank_group as rank_group
    import engine.distributed.tp_model as tp_model
    from engine.loader.checkpoint import load_checkpoint
    from tests.engine.tiny_model import make_engine

    class Reporting(rank_group.RankGroup):
        # Starting: prints the child's pid once it said hello, and never joins the group it now waits in.
        def _expect(self, conn, rank, kind):
            message = super()._expect(conn, rank, kind)
            if kind is rank_group.Hello and sys.argv[2] == "starting":
                print(*self.pids, flush=True)
                time.sleep(300)
            return message

    if __name__ == "__main__":
        tp_model.RankGroup = Reporting
        engine = make_engine(load_checkpoint(sys.argv[1]), tensor_parallel_size=2, num_threads=1)
        print(*engine.runner.model.ranks.pids, flush=True)
        time.sleep(300)
""")


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_ranks_die_with_the_engine_process(tiny_model_dir: Path, tmp_path: Path, when: str) -> None:
    """Rank 0's process SIGKILLed: its child rank ends, whether idle between steps or still starting, waiting in
    the group's rendezvous for a rank 0 that will never come (not for the 300 s start-up timeout). Rank 0's death
    reaches a child several ways: its watch on rank 0's sentinel, its pipe's EOF, the store's and gloo's sockets."""
    script = tmp_path / "rank0.py"
    script.write_text(_RANK_0)
    repo = str(Path(__file__).parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    rank0 = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir), when], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        (pid,) = map(int, rank0.stdout.readline().split())  # type: ignore[union-attr]
        assert _alive(pid)
        time.sleep(0.5)  # past its hello: in the rendezvous when starting
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"rank 1 (pid {pid}) outlived the engine's process"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def llama_1b_cut():  # noqa: ANN201
    """The llama-3.2-1b shape (hidden 2048, 32 query / 8 KV heads, intermediate 8192) cut to one layer and an 8k
    vocabulary: the head split of the 1B model at a fraction of its weights. Dummy weights, float32."""
    from engine.loader.checkpoint import Checkpoint
    from engine.loader.dummy_shapes import DUMMY_SHAPES, byte_level_tokenizer
    from engine.loader.dummy_weights import dummy_weights

    config = dataclasses.replace(DUMMY_SHAPES["llama-3.2-1b"], num_layers=1, vocab_size=8192, bos_token_id=None,
                                 eos_token_ids=(8191,), max_position_embeddings=256)
    return Checkpoint(config=config, weights=dummy_weights(config, dtype=torch.float32),
                      tokenizer=byte_level_tokenizer(config), path=Path("<dummy>/llama-3.2-1b-cut"),
                      model_id="dummy:llama-3.2-1b-cut")


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_1b_shape_matches_tp1(llama_1b_cut, tp: int) -> None:  # noqa: ANN001
    pair = Pair(llama_1b_cut, tp, block_size=16, num_kv_blocks=16, max_model_len=128, num_threads=1)
    try:
        prompts = [list(range(7, 7 + n)) for n in (5, 20)]
        pair.check({f"r{i}": (p, greedy(4)) for i, p in enumerate(prompts)})
        assert pair.tpn.runner.kv_cache.shape[4] == 8 // tp  # this rank's KV heads
    finally:
        pair.close()
