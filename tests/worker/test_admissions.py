"""The count of requests a worker took in that its engine does not hold yet (worker/admissions.py)."""

from __future__ import annotations

import threading

import pytest

from worker.admissions import Admissions


def test_each_request_counts_once_until_it_leaves_however_often_it_leaves() -> None:
    admissions = Admissions()
    first, second = admissions.enter(), admissions.enter()
    assert admissions.count == 2
    first.leave()
    first.leave()  # its command left, then its handler's `finally`
    assert admissions.count == 1
    second.leave()
    assert admissions.count == 0


def test_then_leaves_before_the_command_runs_even_when_the_command_refuses() -> None:
    admissions = Admissions()
    admission = admissions.enter()
    seen = []
    assert admission.then(lambda engine: seen.append(admissions.count) or engine)("engine") == "engine"
    assert seen == [0] and admissions.count == 0

    def refuse(engine: str) -> None:
        raise ValueError("prompt too long")

    refused = admissions.enter()
    with pytest.raises(ValueError):
        refused.then(refuse)("engine")
    assert admissions.count == 0


def test_leaving_from_two_threads_at_once_counts_once() -> None:
    admissions = Admissions()
    tickets = [admissions.enter() for _ in range(2000)]
    barrier = threading.Barrier(2)

    def leave_all() -> None:
        barrier.wait()
        for ticket in tickets:
            ticket.leave()

    threads = [threading.Thread(target=leave_all) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admissions.count == 0
