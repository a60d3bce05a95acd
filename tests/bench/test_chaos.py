"""bench/chaos.py's bookkeeping without a cluster: how each response is judged, the seeded fault schedule, which
faults a cluster can take, and what the host partition does and says."""

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
    assert len(names) == 7
    order = chaos.schedule(names, 19, random.Random(0))
    assert len(order) == 19
    for start in range(0, 14, 7):
        assert sorted(order[start:start + 7]) == sorted(names)
    assert order == chaos.schedule(names, 19, random.Random(0))
    assert order != chaos.schedule(names, 19, random.Random(1))


class FakeCluster:
    """What leaked_blocks and index_problems read: the pools, each worker's GetLoad, the index's listing."""

    api_headers: dict[str, str] = {}

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


# -- which faults a cluster takes; the host partition --------------------------------------------------------------
def test_only_the_partition_is_unavailable_on_loopback_and_it_says_why() -> None:
    from bench.chaos_clusters import LoopbackCluster, NetnsCluster, choose_hosts

    loopback = LoopbackCluster.__new__(LoopbackCluster)  # what `unavailable` reads needs no running cluster
    netns = NetnsCluster.__new__(NetnsCluster)
    faults = chaos.make_faults(stop_s=20)
    assert {n: f.unavailable(loopback) for n, f in faults.items() if f.unavailable(loopback)} == {
        "partition_host": "every worker runs on this one host (loopback): a partition needs --hosts netns"}
    assert not any(f.unavailable(netns) for f in faults.values())
    assert choose_hosts("loopback") == ("loopback", "asked for")
    with pytest.raises(ValueError):
        choose_hosts("k8s")


class PartitionedCluster:
    """The pools on three hosts; cut / heal recorded; while a host is cut, the controller restarts one of its
    workers (a new incarnation, on the spare host)."""

    sizes = {"prefill": 2, "decode": 2}

    def __init__(self) -> None:
        self.workers = [{"worker_id": w, "role": w.split("-")[0], "state": "serving", "incarnation": 1, "node": n}
                        for w, n in (("prefill-0", "h1"), ("prefill-1", "h2"), ("decode-0", "h1"),
                                     ("decode-1", "h3"))]
        self.events: list[str] = []
        self.cut_host: str | None = None

    def pools(self) -> list[dict]:
        if self.cut_host is not None:  # the controller gave the cut host's decode worker up meanwhile
            return [w if not (w["node"] == self.cut_host and w["role"] == "decode")
                    else w | {"incarnation": 2, "node": "spare"} for w in self.workers]
        return self.workers

    def host_of(self, worker: dict) -> str:
        return worker["node"]

    def cut(self, host: str) -> None:
        self.events.append(f"cut {host}")
        self.cut_host = host

    def heal(self, host: str) -> None:
        self.events.append(f"heal {host}")
        self.cut_host = None


def test_a_partition_cuts_a_seeded_workers_host_heals_it_and_says_what_became_of_its_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import chaos_faults

    slept: list[float] = []
    monkeypatch.setattr(chaos_faults.time, "sleep", slept.append)
    fault = chaos_faults.PartitionHost(partition_s=15)
    said = {}
    for seed in range(12):  # seeded: the same victim for a seed, and every host of a pool worker in some seed
        cluster = PartitionedCluster()
        what = fault.inject(cluster, random.Random(seed))  # type: ignore[arg-type]
        (host,) = {e.split()[1] for e in cluster.events}
        assert cluster.events == [f"cut {host}", f"heal {host}"] and slept[-1] == 15
        assert what == fault.inject(PartitionedCluster(), random.Random(seed))  # type: ignore[arg-type]
        said[host] = what
    assert said == {
        "h1": "cut host h1 off for 15 s, healed; during the cut: worker decode-0 given up, restarted on host spare, "
              "worker prefill-0 kept",
        "h2": "cut host h2 off for 15 s, healed; during the cut: worker prefill-1 kept",
        "h3": "cut host h3 off for 15 s, healed; during the cut: worker decode-1 given up, restarted on host spare",
    }


def test_a_partition_heals_the_host_even_when_the_wait_is_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import chaos_faults

    def interrupted(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(chaos_faults.time, "sleep", interrupted)
    cluster = PartitionedCluster()
    with pytest.raises(KeyboardInterrupt):
        chaos_faults.PartitionHost(partition_s=15).inject(cluster, random.Random(0))  # type: ignore[arg-type]
    assert [e.split()[0] for e in cluster.events] == ["cut", "heal"]


def test_the_cut_handoffs_failure_is_read_before_a_later_restart_can_take_its_count() -> None:
    """A worker's kv_transfer_failures counter restarts with its incarnation: the run reads it after the cut, until
    it grows or the time is up, and keeps the most it saw (tests/cluster/test_chaos.py failed once without it)."""
    readings = iter([0.0, 0.0, 1.0, 0.0])  # the failure shows on the third reading; a restart later zeroes it
    assert chaos._await_more(lambda: next(readings), 0.0, until_s=float("inf"), period_s=0.0) == 1.0
    assert chaos._await_more(lambda: 0.0, 0.0, until_s=0.0, period_s=0.0) == 0.0  # time up: the last value read
