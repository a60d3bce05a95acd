"""prefill_worker's runtime KV-cut trigger (SPLITSERVE_FAULT_KV_CUT_FILE, bench/chaos.py's "cut a KV transfer"):
each file created cuts exactly one handoff, whichever worker takes it; the start-up count (SPLITSERVE_FAULT_KV_CUTS)
is spent first."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from prefill_worker.worker import FAULT_KV_CUT_FILE_ENV, PrefillWorker


def _worker(cuts_left: int = 0) -> SimpleNamespace:
    return SimpleNamespace(_cuts_left=cuts_left, _cuts_lock=threading.Lock())


def test_each_file_created_cuts_one_handoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trigger = tmp_path / "cut"
    monkeypatch.setenv(FAULT_KV_CUT_FILE_ENV, str(trigger))
    first, second = _worker(), _worker()
    assert not PrefillWorker._take_cut(first)  # type: ignore[arg-type]
    trigger.touch()
    assert PrefillWorker._take_cut(first)  # type: ignore[arg-type]
    assert not trigger.exists()
    assert not PrefillWorker._take_cut(second)  # type: ignore[arg-type]  # taken already, by the first
    trigger.touch()
    assert PrefillWorker._take_cut(second)  # type: ignore[arg-type]
    assert not PrefillWorker._take_cut(first)  # type: ignore[arg-type]


def test_the_start_up_count_is_spent_before_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trigger = tmp_path / "cut"
    trigger.touch()
    monkeypatch.setenv(FAULT_KV_CUT_FILE_ENV, str(trigger))
    worker = _worker(cuts_left=1)
    assert PrefillWorker._take_cut(worker)  # type: ignore[arg-type]
    assert worker._cuts_left == 0 and trigger.exists()
    assert PrefillWorker._take_cut(worker)  # type: ignore[arg-type]
    assert not trigger.exists()


def test_without_the_variable_nothing_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_KV_CUT_FILE_ENV, raising=False)
    assert not PrefillWorker._take_cut(_worker())  # type: ignore[arg-type]
