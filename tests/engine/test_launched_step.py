"""engine/launched_step.py: a step whose sampling is deferred until its grammar bitmask is filled launches it once,
on the first of `finalize`, `token_ids` and `result()`; its error surfaces from each of them; `token_of` reads one
request's token from any thread. (The deferral end to end, with real grammars under async scheduling:
tests/engine/structured/test_structured_real.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.launched_step import LaunchedStep
from engine.sampling.sampler import LaunchedSample


def _sample(tokens: list[int]) -> LaunchedSample:
    return LaunchedSample(torch.tensor(tokens, dtype=torch.int64), None, len(tokens))


def test_deferred_sampling_runs_once_on_first_use() -> None:
    calls = []

    def launch() -> LaunchedSample:
        calls.append(1)
        return _sample([7, 9])

    step = LaunchedStep(request_ids=["a", "b"], deferred=launch)
    assert step.row_of == {"a": 0, "b": 1} and not calls  # nothing launched yet
    assert step.token_ids.tolist() == [7, 9] and len(calls) == 1
    step.finalize()
    assert step.result()[0] == {"a": [7], "b": [9]} and len(calls) == 1
    assert (step.token_of("a"), step.token_of("b")) == (7, 9)


def test_a_deferred_sampling_that_fails_fails_every_reader() -> None:
    step = LaunchedStep(request_ids=["a"], deferred=lambda: (_ for _ in ()).throw(RuntimeError("fill failed")))
    for read in (step.finalize, lambda: step.token_ids, step.result):
        with pytest.raises(RuntimeError, match="fill failed"):
            read()


def test_token_of_and_result_from_two_threads_agree() -> None:
    step = LaunchedStep(request_ids=[f"r{i}" for i in range(64)], sample=_sample(list(range(100, 164))))
    seen: dict[str, int] = {}
    reader = threading.Thread(target=lambda: seen.update({f"r{i}": step.token_of(f"r{i}") for i in range(64)}))
    reader.start()
    result = step.result()[0]
    reader.join()
    assert seen == {request_id: tokens[0] for request_id, tokens in result.items()}


def test_a_step_done_at_launch_has_no_rows() -> None:
    step = LaunchedStep.done(({"a": [1, 2]}, {}, {}))
    step.finalize()
    assert step.token_ids is None and step.row_of == {} and step.result()[0] == {"a": [1, 2]}


def test_a_quiet_finalize_launches_but_leaves_the_error_to_the_readers() -> None:
    step = LaunchedStep(request_ids=["a"], deferred=lambda: (_ for _ in ()).throw(RuntimeError("fill failed")))
    step.finalize(quiet=True)  # the runner, launching the next step
    step.finalize(quiet=True)
    with pytest.raises(RuntimeError, match="fill failed"):
        step.result()
