"""bench/chaos.py's bookkeeping without a cluster: how each response is judged, and the seeded fault schedule."""

from __future__ import annotations

import random

from bench import chaos
from tests.cluster.load import Outcome

PROMPT_A, PROMPT_B = chaos.PROMPTS[:2]
EXPECTED = {PROMPT_A: " and the sea", PROMPT_B: " Mercury is"}


def _done(prompt: str, text: str, num_tokens: int = 3) -> Outcome:
    return Outcome(status=200, completed=True, num_tokens=num_tokens, ttft_s=0.1, prompt=prompt, text=text)


def test_each_response_is_judged_against_its_own_prompts_answer() -> None:
    outcomes = [
        _done(PROMPT_A, " and the sea"),
        _done(PROMPT_B, " Mercury is"),
        _done(PROMPT_A, " Mercury is"),  # another prompt's answer: wrong
        _done(PROMPT_B, " Mercury is", num_tokens=2),  # the right text but a token short: wrong
        Outcome(status=200, completed=False, num_tokens=1, ttft_s=0.1, error="worker lost", prompt=PROMPT_A),
        Outcome(status=503, completed=False, num_tokens=0, ttft_s=None, retry_after="1", prompt=PROMPT_A),
        Outcome(status=429, completed=False, num_tokens=0, ttft_s=None, retry_after="2", prompt=PROMPT_B),
        Outcome(status=503, completed=False, num_tokens=0, ttft_s=None, prompt=PROMPT_B),  # no Retry-After
        Outcome(status=0, completed=False, num_tokens=0, ttft_s=None, error="reset", prompt=PROMPT_B),
        Outcome(status=0, completed=False, num_tokens=0, ttft_s=None, prompt=PROMPT_A, hung=True),
    ]
    report = chaos.ChaosReport(config={})
    chaos.classify(outcomes, EXPECTED, 3, report)
    assert (report.requests_sent, report.completed_correct, report.completed_wrong, report.hung) == (10, 2, 2, 1)
    assert report.clean_errors == {"sse_error": 1, "503": 1, "429": 1}
    assert report.unclean_errors == {"503": 1, "0": 1}
    assert report.correct_fraction == 0.2
    assert [w["got"] for w in report.wrong_examples] == [" Mercury is", " Mercury is"]
    assert not report.ok()


def test_a_clean_run_is_ok_and_a_leak_or_a_stale_index_is_not() -> None:
    report = chaos.ChaosReport(config={}, index_consistent=True, leaked_blocks={"decode-0": 0, "prefill-0": 0})
    chaos.classify([_done(PROMPT_A, " and the sea")], EXPECTED, 3, report)
    assert report.ok()
    report.leaked_blocks["decode-0"] = 2
    assert not report.ok()
    report.leaked_blocks["decode-0"] = 0
    report.index_consistent = False
    assert not report.ok()


def test_the_schedule_has_every_fault_once_per_round_in_a_seeded_order() -> None:
    names = list(chaos.make_faults(chaos.ChaosConfig()))
    assert len(names) == 6
    order = chaos.schedule(names, 19, random.Random(0))
    assert len(order) == 19
    for start in range(0, 18, 6):
        assert sorted(order[start:start + 6]) == sorted(names)
    assert order == chaos.schedule(names, 19, random.Random(0))
    assert order != chaos.schedule(names, 19, random.Random(1))
