"""bench/chaos.py's bookkeeping without a cluster: how each response is judged, and the seeded fault schedule."""

from __future__ import annotations

import random

import pytest

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
    names = list(chaos.make_faults(stop_s=20))
    assert len(names) == 6
    order = chaos.schedule(names, 19, random.Random(0))
    assert len(order) == 19
    for start in range(0, 18, 6):
        assert sorted(order[start:start + 6]) == sorted(names)
    assert order == chaos.schedule(names, 19, random.Random(0))
    assert order != chaos.schedule(names, 19, random.Random(1))


class FakeCluster:
    """What leaked_blocks and index_problems read: the pools, each worker's GetLoad, the index's listing."""

    def __init__(self, pools: list[dict], loads: dict[str, dict], index: list[dict]) -> None:
        self.url = "http://fake"
        self._pools, self._loads, self.index = pools, loads, index

    def pools(self) -> list[dict]:
        return self._pools

    def load(self, endpoint: str):  # type: ignore[no-untyped-def]
        from protos import serving_pb2

        return serving_pb2.LoadStats(**self._loads[endpoint])


def _fake(monkeypatch: pytest.MonkeyPatch, index: list[dict], used: int = 0, queries: int = 5) -> FakeCluster:
    pools = [{"worker_id": w, "endpoint": w, "incarnation": 7} for w in ("prefill-0", "decode-0")]
    loads = {w["endpoint"]: {"kv_blocks_used": used, "prefix_cache_queries": queries} for w in pools}
    cluster = FakeCluster(pools, loads, index)

    class Response:
        def json(self) -> dict:
            return {"up": True, "workers": cluster.index}

    monkeypatch.setattr(chaos.httpx, "get", lambda *a, **k: Response())
    return cluster


def _entry(worker_id: str, incarnation: int = 7, num_blocks: int = 3, live: bool = True) -> dict:
    return {"worker_id": worker_id, "incarnation": incarnation, "num_blocks": num_blocks, "live": live}


def test_the_index_must_hold_exactly_the_pools_current_incarnations(monkeypatch: pytest.MonkeyPatch) -> None:
    good = [_entry("prefill-0"), _entry("decode-0")]
    assert chaos.index_problems(_fake(monkeypatch, good), timeout_s=0) == []
    stale = [*good, _entry("prefill-0", incarnation=3, live=False)]  # a restarted worker's old entries
    assert chaos.index_problems(_fake(monkeypatch, stale), timeout_s=0) == [f"stale entry {stale[2]}"]
    gone = [*good, _entry("decode-9")]  # a worker no longer in the pools
    assert chaos.index_problems(_fake(monkeypatch, gone), timeout_s=0) == [f"stale entry {gone[2]}"]
    missing = chaos.index_problems(_fake(monkeypatch, good[:1]), timeout_s=0)  # decode-0 served, not resynced
    assert missing == ["decode-0 (incarnation 7) served but has no index entry"]
    assert chaos.index_problems(_fake(monkeypatch, good[:1], queries=0), timeout_s=0) == []  # it served nothing


def test_blocks_still_used_after_the_drain_are_leaked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chaos.leaked_blocks(_fake(monkeypatch, [], used=0), timeout_s=0) == {"prefill-0": 0, "decode-0": 0}
    assert chaos.leaked_blocks(_fake(monkeypatch, [], used=2), timeout_s=0) == {"prefill-0": 2, "decode-0": 2}
