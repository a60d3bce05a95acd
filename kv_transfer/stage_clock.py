"""Where one handoff's time goes: cheap stage timers the transports keep, always on.

    clock = StageClock()             at the start of a handoff (one per handoff, never shared between handoffs)
    ... work ...; clock.lap("gather")   the time since the previous lap (or the start) is added to "gather"
    clock.mark("call")               notes the time now under "call" (when a control call left), charging nothing
    clock.done()                     stops it: `stages_s` (stage → seconds), `start_s` / `end_s`

A lap is one `time.perf_counter()` and a dict update (~0.2 µs), so the transports lap a few times per block at
most. A stage lapped several times (once per block) accumulates. Stages are named by what the code between two laps
does; where one pass does several things (the CPU's fused gather + CRC-32C + frame), the name says so
("gather+crc+frame"). The names a transport uses are listed in its module docstring.

Who reads them:
- the sender: `TransferResult.stages_s` of each `send` (the sender's own stages; the gap between their sum and the
  send's wall time is Python and waiting the code did not lap);
- the receiver: `KVReceiver.stage_log`, its last LOG_SIZE handoffs by transfer id, with the handler's start and end
  on the same clock (`time.perf_counter`, CLOCK_MONOTONIC on Linux: comparable across the processes of one host, so a
  benchmark can subtract the receiver's handler time from the sender's call time to see what the RPC itself costs);
  and a DEBUG line on `kv_transfer.stage_clock` per handoff.

bench/handoff_cost.py prints both sides per transport.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LOG_SIZE = 256  # handoffs a receiver's stage log keeps


class StageClock:
    """Accumulates the wall time between laps into named stages. Not thread-safe by itself: the laps of one handoff
    come from one thread at a time (a sender's gRPC thread while it streams, then the caller's thread)."""

    __slots__ = ("start_s", "end_s", "stages_s", "marks_s", "_last_s")

    def __init__(self) -> None:
        self.start_s = self._last_s = time.perf_counter()
        self.end_s: float | None = None
        self.stages_s: dict[str, float] = {}
        self.marks_s: dict[str, float] = {}  # moments by name, on `time.perf_counter`'s clock

    def lap(self, stage: str) -> None:
        """Add the time since the previous lap (or the start) to `stage`."""
        now_s = time.perf_counter()
        self.stages_s[stage] = self.stages_s.get(stage, 0.0) + (now_s - self._last_s)
        self._last_s = now_s

    def mark(self, name: str) -> None:
        """Note the time now under `name` (the last mark of a name wins)."""
        self.marks_s[name] = time.perf_counter()

    def skip(self) -> None:
        """Restart the current interval without charging it to any stage (time the caller accounts elsewhere)."""
        self._last_s = time.perf_counter()

    def done(self) -> StageClock:
        """Stop the clock (the end of the handoff); returns itself."""
        if self.end_s is None:
            self.end_s = time.perf_counter()
        return self

    @property
    def total_s(self) -> float:
        return (self.end_s if self.end_s is not None else time.perf_counter()) - self.start_s


@dataclass(frozen=True, kw_only=True)
class StageRecord:
    """One handoff as a receiver saw it: its stages and the handler's start and end (`time.perf_counter`)."""

    transfer_id: str
    ok: bool
    start_s: float
    end_s: float
    stages_s: dict[str, float]


class StageLog:
    """A receiver's last LOG_SIZE handoffs' stage records; thread-safe."""

    def __init__(self, size: int = LOG_SIZE) -> None:
        self._lock = threading.Lock()
        self._records: collections.deque[StageRecord] = collections.deque(maxlen=size)

    def add(self, transfer_id: str, clock: StageClock, *, ok: bool) -> None:
        clock.done()
        assert clock.end_s is not None
        record = StageRecord(transfer_id=transfer_id, ok=ok, start_s=clock.start_s, end_s=clock.end_s,
                             stages_s=dict(clock.stages_s))
        with self._lock:
            self._records.append(record)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("KV handoff %s received (%s) in %.3f ms: %s", transfer_id, "ok" if ok else "failed",
                         (record.end_s - record.start_s) * 1e3,
                         ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in record.stages_s.items()))

    def records(self) -> list[StageRecord]:
        with self._lock:
            return list(self._records)

    def take(self) -> list[StageRecord]:
        """The records so far, and forget them."""
        with self._lock:
            records = list(self._records)
            self._records.clear()
        return records
