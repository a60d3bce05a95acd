"""Sampling and output semantics end to end, through the engine and the offline API (vLLM's meanings).

Seeds (batch- and position-independent), stop strings, stop token ids, EOS with ignore_eos and min_tokens,
max_tokens, logprobs, streaming deltas, `LLM.generate` / `LLM.chat` ordering, and the engine's statistics.
The tiny random-weight model drives nearly all of it: what a test expects (a stop string the text reaches, an
EOS id the model will emit) is derived from a first greedy run. One slow test repeats the text-level checks on
the real model, whose tokens are real words.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine import SamplingParams
from tests.engine.tiny_model import (
    BOS_ID,
    PROMPTS,
    assert_no_blocks_held,
    drain,
    finals,
    greedy,
    make_engine,
    num_tokens_to_reach,
    pick_stop_string,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _run_one(engine, prompt, params: SamplingParams, request_id: str = "one"):  # noqa: ANN001, ANN202
    engine.add_request(request_id, prompt, params)
    return finals(drain(engine))[request_id]


# -- seeds -----------------------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, top_k=200, seed=1234, max_tokens=16, ignore_eos=True)


def _noise_requests(engine, prefix: str) -> None:  # noqa: ANN001
    for i, prompt in enumerate([PROMPTS[0], list(range(50, 83)), PROMPTS[3]]):
        engine.add_request(f"{prefix}{i}", prompt, SamplingParams(temperature=1.2, max_tokens=5 + 7 * i))


def test_seeded_request_gives_the_same_output_whatever_the_batch(tiny_checkpoint) -> None:
    alone = _run_one(make_engine(tiny_checkpoint), PROMPTS[1], SEEDED).token_ids

    behind_others = make_engine(tiny_checkpoint)
    _noise_requests(behind_others, "noise")  # three random requests ahead of it in the queue
    behind_others.add_request("seeded", PROMPTS[1], SEEDED)
    behind = finals(drain(behind_others))["seeded"].token_ids

    chunked = make_engine(tiny_checkpoint, max_num_batched_tokens=7)  # first in line, prefill in chunks
    chunked.add_request("seeded", PROMPTS[1], SEEDED)
    chunked.add_request("twin", PROMPTS[1], SEEDED)  # the same seed twice in one batch: two equal streams
    _noise_requests(chunked, "noise")
    out = finals(drain(chunked))

    assert len(alone) == 16
    assert behind == alone
    assert out["seeded"].token_ids == alone and out["twin"].token_ids == alone


def test_different_seeds_give_different_outputs(tiny_engine) -> None:
    for seed in range(4):
        tiny_engine.add_request(f"s{seed}", PROMPTS[1], dataclasses.replace(SEEDED, seed=seed))
    out = finals(drain(tiny_engine))

    assert len({tuple(o.token_ids) for o in out.values()}) == 4


def test_engine_seed_makes_unseeded_requests_reproducible(tiny_checkpoint) -> None:
    def run(seed: int) -> dict[str, list[int]]:
        engine = make_engine(tiny_checkpoint, seed=seed)
        _noise_requests(engine, "r")
        return {r: o.token_ids for r, o in finals(drain(engine)).items()}

    assert run(7) == run(7)
    assert run(7) != run(8)


# -- how a request ends ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):  # noqa: ANN201
    """Greedy, 24 tokens, for PROMPTS[1]: what the stop tests cut."""
    return _run_one(make_engine(tiny_checkpoint), PROMPTS[1], greedy(max_tokens=24))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_output(tiny_engine, reference, include: bool) -> None:
    stop = pick_stop_string(reference.text, start=8)
    cut = reference.text.find(stop)
    num_tokens = num_tokens_to_reach(tiny_engine.tokenizer, reference.token_ids, stop)

    out = _run_one(tiny_engine, PROMPTS[1], greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=include))

    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == reference.text[: cut + len(stop) if include else cut]
    assert out.token_ids == reference.token_ids[:num_tokens]
    assert_no_blocks_held(tiny_engine)


def test_earliest_of_several_stop_strings_wins(tiny_engine, reference) -> None:
    early = pick_stop_string(reference.text, start=4)
    late = pick_stop_string(reference.text, start=reference.text.find(early) + 3)
    assert reference.text.find(early) < reference.text.find(late)

    out = _run_one(tiny_engine, PROMPTS[1], greedy(max_tokens=24, stop=[late, early]))

    assert out.stop_reason == early and out.text == reference.text[: reference.text.find(early)]


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(tiny_engine, reference) -> None:
    stop = pick_stop_string(reference.text, start=8)
    num_tokens = num_tokens_to_reach(tiny_engine.tokenizer, reference.token_ids, stop)

    out = _run_one(tiny_engine, PROMPTS[1], greedy(max_tokens=num_tokens, stop=[stop]))

    # The text was cut at the stop string, so that is why it ended, as in vLLM (not "length").
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == reference.text[: reference.text.find(stop)] and len(out.token_ids) == num_tokens


def test_stop_token_id_ends_the_output(tiny_engine, reference) -> None:
    stop_id = reference.token_ids[3]
    first = reference.token_ids.index(stop_id)

    out = _run_one(tiny_engine, PROMPTS[1], greedy(max_tokens=24, stop_token_ids=[stop_id]))

    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == reference.token_ids[: first + 1]


def test_stop_token_id_is_held_off_until_min_tokens(tiny_engine, reference) -> None:
    stop_id = reference.token_ids[0]

    out = _run_one(tiny_engine, PROMPTS[1], greedy(max_tokens=24, stop_token_ids=[stop_id], min_tokens=3))

    assert len(out.token_ids) >= 3 and stop_id not in out.token_ids[:3]
    assert out.finish_reason == "length" or (out.finish_reason, out.token_ids[-1]) == ("stop", stop_id)


def test_max_tokens_ends_with_length(tiny_engine) -> None:
    out = _run_one(tiny_engine, PROMPTS[0], greedy(max_tokens=11))

    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("length", None, 11)


def test_max_tokens_none_runs_to_max_model_len(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint, max_model_len=32, num_kv_blocks=8)
    prompt = list(range(3, 23))

    out = _run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))

    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 32


@pytest.fixture(scope="module")
def eos_engine_factory(tiny_checkpoint):  # noqa: ANN201
    """Engines over the tiny model whose tokenizer also ends generation on the first greedy token of PROMPTS[1]:
    a model that "wants" to stop at once."""
    from engine.tokenizer.tokenizer import Tokenizer

    first = _run_one(make_engine(tiny_checkpoint), PROMPTS[1], greedy(max_tokens=1)).token_ids[0]
    spec = tiny_checkpoint.tokenizer.spec
    tokenizer = Tokenizer(dataclasses.replace(spec, extra_eos_token_ids=(*spec.extra_eos_token_ids, first)))
    checkpoint = dataclasses.replace(tiny_checkpoint, tokenizer=tokenizer)
    return first, lambda: make_engine(checkpoint)


def test_eos_ends_the_output_unless_ignored(eos_engine_factory) -> None:
    eos_id, new_engine = eos_engine_factory
    stopped = _run_one(new_engine(), PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10))
    ignored = _run_one(new_engine(), PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))

    assert (stopped.finish_reason, stopped.stop_reason, stopped.token_ids) == ("stop", None, [eos_id])
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 10 and ignored.token_ids[0] == eos_id


def test_min_tokens_masks_eos(eos_engine_factory) -> None:
    eos_id, new_engine = eos_engine_factory
    engine = new_engine()

    out = _run_one(engine, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4))

    assert len(out.token_ids) >= 4
    assert not set(out.token_ids[:4]) & set(engine.tokenizer.eos_token_ids)
    assert out.finish_reason == "length" or (out.finish_reason, out.token_ids[-1]) == ("stop", eos_id)


# -- logprobs ------------------------------------------------------------------------------------------------------


def test_greedy_logprobs_rank_the_chosen_token_first(tiny_engine) -> None:
    out = _run_one(tiny_engine, PROMPTS[2], greedy(max_tokens=9, logprobs=3))

    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 9
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id and lp.rank == 1
        assert len(lp.top) == 3 and lp.top[0][0] == token_id and lp.top[0][1] == lp.logprob
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6


def test_sampled_logprobs_describe_the_sampled_token(tiny_engine) -> None:
    params = SamplingParams(temperature=1.5, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
    out = _run_one(tiny_engine, PROMPTS[2], params)

    assert out.logprobs is not None and len(out.logprobs) == 12
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert any(lp.rank > 1 for lp in out.logprobs)  # a hot sampler does not always pick the most likely token
    for lp in out.logprobs:
        assert len(lp.top) == 2 and lp.logprob <= lp.top[0][1]
        assert (lp.rank == 1) == (lp.token_id == lp.top[0][0])


def test_logprobs_zero_and_none(tiny_engine) -> None:
    tiny_engine.add_request("zero", PROMPTS[0], greedy(max_tokens=3, logprobs=0))
    tiny_engine.add_request("none", PROMPTS[0], greedy(max_tokens=3))
    out = finals(drain(tiny_engine))

    assert out["none"].logprobs is None
    assert out["zero"].logprobs is not None and [lp.top for lp in out["zero"].logprobs] == [[], [], []]
    assert [lp.token_id for lp in out["zero"].logprobs] == out["zero"].token_ids


# -- streaming -----------------------------------------------------------------------------------------------------


def test_streamed_deltas_add_up_to_the_final_output(tiny_checkpoint, reference) -> None:
    stop = pick_stop_string(reference.text, start=8)
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=9)  # chunked prefill: steps with no new token
    requests = {
        "plain": (PROMPTS[0], greedy(max_tokens=20)),
        "stop": (PROMPTS[1], greedy(max_tokens=24, stop=[stop])),
        "stop-kept": (PROMPTS[1], greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True)),
        "sampled": (list(range(60, 90)), SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)),
    }
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)

    outputs = drain(engine)

    assert sorted(outputs) == sorted(requests)
    for request_id, outs in outputs.items():
        final = outs[-1]
        streamed_text, streamed_ids = "", []
        for out in outs:
            streamed_text += out.delta_text
            streamed_ids += out.new_token_ids
            assert final.text.startswith(streamed_text), request_id  # nothing streamed is taken back later
            assert out.token_ids == streamed_ids
            assert out.finish_reason is None if out is not final else out.finish_reason is not None
        assert streamed_text == final.text and streamed_ids == final.token_ids, request_id
    assert outputs["stop"][-1].finish_reason == "stop" and stop not in outputs["stop"][-1].text
    assert outputs["stop-kept"][-1].text.endswith(stop)


# -- the offline API -----------------------------------------------------------------------------------------------



def test_generate_returns_outputs_in_input_order(tiny_llm, tiny_checkpoint) -> None:
    tok = tiny_llm.tokenizer
    prompts = [PROMPTS[0], tok.encode(PROMPTS[1]), PROMPTS[2], list(range(70, 75))]
    lengths = [9, 1, 5, 3]  # the first prompt finishes last

    outs = tiny_llm.generate(prompts, [greedy(max_tokens=n) for n in lengths])

    assert [o.prompt_token_ids for o in outs] == [p if isinstance(p, list) else tok.encode(p) for p in prompts]
    assert [len(o.token_ids) for o in outs] == lengths
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    alone = [_run_one(make_engine(tiny_checkpoint), p, greedy(max_tokens=n)) for p, n in zip(prompts, lengths)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert [o.text for o in outs] == [a.text for a in alone]
    assert_no_blocks_held(tiny_llm.engine)


def test_generate_with_one_params_for_all_and_single_prompts(tiny_llm) -> None:
    outs = tiny_llm.generate(PROMPTS, greedy(max_tokens=4))
    assert len(outs) == len(PROMPTS) and all(len(o.token_ids) == 4 for o in outs)

    (from_text,) = tiny_llm.generate(PROMPTS[0], greedy(max_tokens=4))
    (from_ids,) = tiny_llm.generate(tiny_llm.tokenizer.encode(PROMPTS[0]), greedy(max_tokens=4))
    assert from_text.token_ids == from_ids.token_ids == outs[0].token_ids

    (default,) = tiny_llm.generate(PROMPTS[0])  # SamplingParams(): temperature 1, up to 16 tokens
    assert 1 <= len(default.token_ids) <= 16
    assert tiny_llm.generate([], greedy()) == []


def test_chat_applies_the_template_and_generates(tiny_llm) -> None:
    tok = tiny_llm.tokenizer
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    expected_prompt = tok.encode(tok.apply_chat_template(conversation, add_generation_prompt=True),
                                 add_special_tokens=False)

    (out,) = tiny_llm.chat(conversation, greedy(max_tokens=6))
    (direct,) = tiny_llm.generate(expected_prompt, greedy(max_tokens=6))
    both = tiny_llm.chat([conversation, [{"role": "user", "content": "Hi"}]], [greedy(max_tokens=6), greedy(2)])

    assert out.prompt_token_ids == expected_prompt and expected_prompt[0] == BOS_ID
    assert tok.decode(expected_prompt, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert out.token_ids == direct.token_ids and len(out.token_ids) == 6
    assert [len(o.token_ids) for o in both] == [6, 2] and both[0].token_ids == out.token_ids
    # vLLM's continue_final_message: the prompt ends inside the assistant's partial answer
    partial = [*conversation, {"role": "assistant", "content": "Hello to"}]
    (cont,) = tiny_llm.chat(partial, greedy(max_tokens=2), add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(cont.prompt_token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nHello to")
    assert_no_blocks_held(tiny_llm.engine)


# -- statistics ------------------------------------------------------------------------------------------------------


def test_stats_gauges_counters_and_request_timings(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint, max_num_seqs=2)
    prompts = {"a": list(range(10, 32)), "b": PROMPTS[1], "c": PROMPTS[2]}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(max_tokens=5))
    engine.step()

    running = engine.stats()
    assert (running.num_requests_running, running.num_requests_waiting) == (2, 1)
    # "a" and "b" computed their prompts in the first step (256-token budget); "c" waits with all of its own.
    assert running.num_queued_prompt_tokens == len(engine.tokenizer.encode(prompts["c"]))
    assert running.kv_blocks_used > 0 and running.kv_blocks_used + running.kv_blocks_free == engine.num_kv_blocks
    assert running.kv_cache_usage == running.kv_blocks_used / engine.num_kv_blocks
    assert running.finished == []

    drain(engine)
    engine.add_request("a-again", prompts["a"], greedy(max_tokens=1))
    drain(engine)
    done = engine.stats(take_finished=False)

    num_prompt_tokens = {r: len(o) if isinstance(o, list) else len(engine.tokenizer.encode(o)) for r, o in
                         prompts.items()}
    num_prompt_tokens["a-again"] = 22
    gauges_only = done
    done = engine.stats()  # a gauges-only read (a worker's GetLoad) leaves the finished stats for this one
    assert gauges_only.finished == [] and len(done.finished) == len(num_prompt_tokens)
    assert (done.num_requests_running, done.num_requests_waiting, done.num_queued_prompt_tokens) == (0, 0, 0)
    assert (done.kv_blocks_used, done.kv_blocks_free, done.kv_cache_usage) == (0, engine.num_kv_blocks, 0.0)
    assert done.num_prompt_tokens == sum(num_prompt_tokens.values())
    assert done.num_generation_tokens == 3 * 5 + 1
    assert done.prefix_cache_queries == sum(num_prompt_tokens.values())
    assert done.prefix_cache_hits == 20  # "a-again": 5 of its 22 prompt tokens' blocks, one token recomputed
    assert done.num_preemptions == 0
    # No speculative decoding: the engine's NullSpeculator leaves every spec_decode_* counter at zero.
    assert (done.spec_decode_num_drafts, done.spec_decode_num_draft_tokens, done.spec_decode_num_accepted_tokens,
            done.spec_decode_num_accepted_tokens_per_pos, done.spec_decode_chosen_k) == (0, 0, 0, [], {})
    by_id = {s.request_id: s for s in done.finished}
    assert sorted(by_id) == sorted(num_prompt_tokens)
    for request_id, s in by_id.items():
        assert s.num_prompt_tokens == num_prompt_tokens[request_id]
        assert s.num_output_tokens == (1 if request_id == "a-again" else 5) and s.finish_reason == "length"
        assert 0.0 <= s.queue_time_s <= s.ttft_s <= s.e2e_latency_s and s.tpot_s >= 0.0
    assert by_id["c"].queue_time_s > 0.0  # it waited a step for a running slot
    assert by_id["a-again"].tpot_s == 0.0 and by_id["a-again"].num_cached_tokens == 20
    assert engine.stats().finished == []  # finished stats are handed out once


def test_stats_count_preemptions(tiny_checkpoint) -> None:
    engine = make_engine(tiny_checkpoint, num_kv_blocks=12, max_model_len=48)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(10 + i, 30 + i)), greedy(max_tokens=16))
    drain(engine)

    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_preemptions == sum(s.num_preemptions for s in stats.finished)
    assert stats.kv_blocks_used == 0


# -- the real model ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_chat_stop_string_and_logprobs(smollm2_checkpoint) -> None:
    # Real subword tokens: the stop string below spans two of them (" is", " Paris").
    engine = make_engine(smollm2_checkpoint, block_size=16, num_kv_blocks=64, max_model_len=1024)
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tok.encode(chat, add_special_tokens=False)

    free = _run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2), "free")
    cut = _run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=["s P"]), "cut")
    kept = _run_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=["s P"],
                                                   include_stop_str_in_output=True), "kept")

    assert (free.text, free.finish_reason, free.stop_reason) == ("The capital of France is Paris.", "stop", None)
    assert free.token_ids[-1] in tok.eos_token_ids  # <|im_end|>, dropped from the text as a special token
    assert (cut.finish_reason, cut.stop_reason, cut.text) == ("stop", "s P", "The capital of France i")
    assert kept.text == "The capital of France is P"
    assert cut.token_ids == kept.token_ids == free.token_ids[: len(cut.token_ids)]
    assert free.logprobs is not None and len(free.logprobs) == len(free.token_ids)
    assert [lp.top[0][0] for lp in free.logprobs] == free.token_ids and all(lp.rank == 1 for lp in free.logprobs)
    assert_no_blocks_held(engine)
