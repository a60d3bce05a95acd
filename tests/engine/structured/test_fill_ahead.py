"""Filling the grammar bitmask ahead, on the matchers' own thread (engine/structured/fill_ahead.py): on for cuda
engines only, so these tests force it on a CPU engine over the tiny model (`grammars.fill_ahead = True`).

    the CPU path is the old one            no pending bitmask reaches the sampler, no fill thread starts
    forced on: the same tokens             a mixed batch (JSON schema, regex, choice, unconstrained; greedy and
                                           seeded) and a speculating engine give the tokens of the in-step fill
    the thread never outlives its engine   it ends when the engine is collected (or the matchers closed)
    a failed fill                          is the step's requests' error, not a hang; blocks and matchers go back
    a failed forward                       releases its requests only once their fill has finished with them
    a pin that fails (matchers told cuda)  leaves the bitmask unpinned, and the step still gets its mask
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from engine.request.grammar_spec import GrammarSpec
from engine.request.sampling_params import SamplingParams
from engine.structured.bitmask import PendingBitmask, TokenBitmask
from engine.structured.fill_ahead import THREAD_NAME, FillAhead
from tests.engine.tiny_model import assert_no_blocks_held, drain, finals, make_engine

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["kind", "count", "ok"],
    "properties": {"kind": {"enum": ["book", "film", "song"]}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999}, "ok": {"type": "boolean"}},
}
PROMPTS = ["Hello world", "The quick brown fox", "def main():", "Serving language models", "Once upon a time"]


def batch_params() -> list[SamplingParams]:
    json_spec = GrammarSpec.json_schema(SCHEMA)
    return [
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=json_spec),
        SamplingParams(temperature=0.9, seed=7, max_tokens=80, structured_outputs=json_spec, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=GrammarSpec(kind="regex",
                                                                                       source=r"(ab|cd){2,6}x")),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # unconstrained rows in the same steps
        SamplingParams(temperature=0.7, seed=3, max_tokens=40, structured_outputs=GrammarSpec.choice(["yes", "no"])),
    ]


def fill_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)}


def run_batch(engine, fill_ahead: bool) -> tuple[dict[str, list[int]], list[type]]:  # noqa: ANN001
    """Every request's tokens, and the kinds of bitmask the sampler was given, step by step."""
    engine.inputs.grammar_compilers()  # makes the runner's matchers
    if fill_ahead:
        engine.runner.grammars.fill_ahead = True
    seen: list[type] = []
    launch = engine.runner.sampler.launch  # what the runner calls (sample is launch(...).result())

    def spy(logits, rows, token_bitmask=None):  # noqa: ANN001, ANN202
        if token_bitmask is not None:
            seen.append(type(token_bitmask))
        return launch(logits, rows, token_bitmask)

    engine.runner.sampler.launch = spy
    for i, (prompt, params) in enumerate(zip(PROMPTS, batch_params(), strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    outs = finals(drain(engine))
    assert_no_blocks_held(engine)
    assert engine.runner.grammars.num_requests == 0, "grammar matchers leaked"
    assert all(o.error is None for o in outs.values()), {k: o.error for k, o in outs.items()}
    return {k: o.token_ids for k, o in outs.items()}, seen


@pytest.fixture
def closing() -> Iterator[list]:
    """Engines whose fill threads the test started: their matchers are closed after it."""
    engines: list = []
    yield engines
    for engine in engines:
        engine.runner.grammars.close()


def test_a_cpu_engine_fills_in_the_step_as_before(tiny_checkpoint, torch_single_thread) -> None:  # noqa: ANN001
    before = fill_threads()
    engine = make_engine(tiny_checkpoint)
    tokens, seen = run_batch(engine, fill_ahead=False)
    assert engine.runner.grammars.fill_ahead is False
    assert seen and set(seen) == {TokenBitmask}
    assert not fill_threads() - before, "a CPU engine started a fill thread"
    assert any(tokens.values())


def test_filling_ahead_gives_the_tokens_of_the_in_step_fill(tiny_checkpoint, torch_single_thread,  # noqa: ANN001
                                                            closing) -> None:
    expected, _ = run_batch(make_engine(tiny_checkpoint), fill_ahead=False)
    engine = make_engine(tiny_checkpoint)
    closing.append(engine)
    got, seen = run_batch(engine, fill_ahead=True)
    assert got == expected
    assert PendingBitmask in seen and set(seen) == {PendingBitmask}  # every constrained step was filled ahead
    assert fill_threads()


def test_filling_ahead_with_speculation(tiny_checkpoint, torch_single_thread, closing) -> None:  # noqa: ANN001
    """Steps with drafts fill in the step (fill_with_drafts), the others ahead; greedy output is the same."""
    spec = GrammarSpec(kind="regex", source=r"(ab|cd){2,9}x")
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=spec)
    prompts = ["ab cd ab cd ab cd ab cd ab cd", "abab abab abab abab"]

    def run(engine) -> tuple[list[list[int]], list[type]]:  # noqa: ANN001
        engine.inputs.grammar_compilers()
        engine.runner.grammars.fill_ahead = True
        closing.append(engine)
        seen: list[type] = []
        launch, verify = engine.runner.sampler.launch, engine.runner.rejection_sampler.verify
        engine.runner.sampler.launch = lambda lg, rows, m=None: (seen.append(type(m)), launch(lg, rows, m))[1]
        engine.runner.rejection_sampler.verify = lambda lg, reqs, m=None: (seen.append(type(m)), verify(lg, reqs, m))[1]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{i}", prompt, params)
        outs = finals(drain(engine))
        assert_no_blocks_held(engine)
        assert engine.runner.grammars.num_requests == 0
        return [outs[f"s{i}"].token_ids for i in range(len(prompts))], seen

    plain, _ = run(make_engine(tiny_checkpoint))
    speculating = make_engine(tiny_checkpoint, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "policy": "fixed", "prompt_lookup_min": 1})
    got, seen = run(speculating)
    assert got == plain
    assert speculating.stats().spec_decode_num_draft_tokens > 0
    assert PendingBitmask in seen and TokenBitmask in seen  # both kinds of step happened


def test_the_fill_thread_ends_with_its_engine(tiny_checkpoint, torch_single_thread) -> None:  # noqa: ANN001
    before = fill_threads()
    engine = make_engine(tiny_checkpoint)
    run_batch(engine, fill_ahead=True)
    [thread] = fill_threads() - before
    assert thread.is_alive()
    del engine
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the grammar fill thread outlived its engine"


def test_closing_the_matchers_ends_the_thread(tiny_checkpoint, torch_single_thread) -> None:  # noqa: ANN001
    before = fill_threads()
    engine = make_engine(tiny_checkpoint)
    run_batch(engine, fill_ahead=True)
    [thread] = fill_threads() - before
    engine.runner.grammars.close()
    assert not thread.is_alive()
    run_batch(engine, fill_ahead=True)  # a later fill starts a new thread
    engine.runner.grammars.close()


@pytest.mark.timeout(120)
def test_a_failed_fill_is_the_requests_error(tiny_checkpoint, torch_single_thread, closing,  # noqa: ANN001
                                             monkeypatch) -> None:
    engine = make_engine(tiny_checkpoint)
    closing.append(engine)
    engine.inputs.grammar_compilers()
    grammars = engine.runner.grammars
    grammars.fill_ahead = True
    fill_rows = grammars._fill_rows

    def failing(*args):  # noqa: ANN002, ANN202
        if threading.current_thread().name.startswith(THREAD_NAME):
            raise RuntimeError("the fill broke")
        return fill_rows(*args)

    monkeypatch.setattr(grammars, "_fill_rows", failing)
    for i, (prompt, params) in enumerate(zip(PROMPTS, batch_params(), strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    outs = finals(drain(engine, max_steps=50))
    assert {o.error for o in outs.values()} == {"engine step failed: the fill broke"}
    assert all(o.finish_reason == "error" for o in outs.values())
    assert_no_blocks_held(engine)
    assert grammars.num_requests == 0
    monkeypatch.undo()  # the same engine and thread serve the next request
    engine.add_request("after", PROMPTS[0], batch_params()[0])
    [after] = finals(drain(engine)).values()
    assert after.error is None and after.finish_reason == "stop"
    assert_no_blocks_held(engine)


@pytest.mark.timeout(120)
def test_a_failed_forward_waits_out_its_fill(tiny_checkpoint, torch_single_thread, closing,  # noqa: ANN001
                                             monkeypatch) -> None:
    """The forward fails while the fill still runs: the step's requests are released (their matchers dropped)
    only once the fill has finished with them."""
    engine = make_engine(tiny_checkpoint)
    closing.append(engine)
    engine.inputs.grammar_compilers()
    grammars = engine.runner.grammars
    grammars.fill_ahead = True
    fill_rows = grammars._fill_rows
    fill_finished = threading.Event()

    def slow(*args):  # noqa: ANN002, ANN202
        time.sleep(0.5)
        fill_rows(*args)
        fill_finished.set()

    def failing_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("the forward broke")

    monkeypatch.setattr(grammars, "_fill_rows", slow)
    monkeypatch.setattr(engine.runner.model, "forward", failing_forward)
    engine.add_request("r", PROMPTS[0], batch_params()[0])
    [out] = engine.step()
    assert fill_finished.is_set(), "the step released its requests while their fill still ran"
    assert out.error == "engine step failed: the forward broke"
    assert_no_blocks_held(engine)
    assert grammars.num_requests == 0


# --- FillAhead on its own ---------------------------------------------------------------------------------------


def test_a_fill_is_taken_only_for_its_key() -> None:
    ahead = FillAhead()
    mask = TokenBitmask(bitmask=torch.zeros(1, 1, dtype=torch.int32), row_indices=[0])
    ahead.start("k", lambda: mask)
    assert ahead.take("other") is None  # drained and dropped
    assert ahead.take("k") is None
    ahead.start("k", lambda: mask)
    pending = ahead.take("k")
    assert pending is not None and pending.wait() is mask
    assert ahead.take("k") is None  # handed over once
    ahead.close()


def test_drain_waits_for_a_handed_over_fill() -> None:
    """A step that fails before its sampler waits still has its fill waited out before the matchers are used."""
    release = threading.Event()
    done = threading.Event()

    def slow():  # noqa: ANN202
        release.wait(10)
        done.set()
        return TokenBitmask(bitmask=torch.zeros(1, 1, dtype=torch.int32), row_indices=[0])

    ahead = FillAhead()
    ahead.start("k", slow)
    assert ahead.take("k") is not None
    threading.Timer(0.2, release.set).start()
    ahead.drain()
    assert done.is_set()
    ahead.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA does")
def test_a_bitmask_that_cannot_be_pinned_is_used_unpinned(caplog) -> None:  # noqa: ANN001
    """Matchers told their engine is on cuda fill ahead and pin; without CUDA the pin fails and the fill still gives
    the step its mask, rows at their logits rows, an unconstrained row allowing everything."""
    from engine.core.request import Request
    from engine.core.scheduler import ScheduledRequest
    from engine.structured.bitmask import unpack_bitmask
    from engine.structured.compiler import GrammarCompilerCache
    from engine.structured.matchers import GrammarMatchers
    from tests.engine.structured.tiny_vocab import EOS_ID, VOCAB_SIZE, TinyTokenizer

    def request(request_id: str, spec: GrammarSpec | None) -> Request:
        r = Request(request_id, [1, 2, 3], SamplingParams(structured_outputs=spec), eos_token_ids=(EOS_ID,),
                    max_tokens=8, hash_namespace=None)
        r.append_output_token(ord("a"))
        return r

    matchers = GrammarMatchers(GrammarCompilerCache(TinyTokenizer(), vocab_size=VOCAB_SIZE),  # type: ignore[arg-type]
                               device=torch.device("cuda", 0))
    assert matchers.fill_ahead
    plain, constrained = request("p", None), request("c", GrammarSpec.choice(["abc", "abd"]))
    matchers.start_fill([ScheduledRequest(request=r, start=3, num_new_tokens=1, block_ids=[0], samples=True)
                         for r in (plain, constrained)])
    pending = matchers.fill([constrained], [1])
    assert isinstance(pending, PendingBitmask)
    mask = pending.wait()
    allowed = unpack_bitmask(mask.bitmask, VOCAB_SIZE)
    assert mask.row_indices == [0, 1] and allowed[0].all()
    assert torch.nonzero(allowed[1]).flatten().tolist() == [ord("b")]
    assert not mask.bitmask.is_pinned() and "stay unpinned" in caplog.text
    matchers.close()
