"""A worker's door for request RPCs (Generate, Prefill): counts the calls it is serving, and shuts to new ones when
the worker drains before a scale-down.

    open ──enter()/exit() per call──▶ close() (drain begins: enter() refuses, a call gets UNAVAILABLE "draining")
         ──await wait_idle(timeout_s)──▶ 0 when every admitted call ended, else how many are still in flight

Every method runs on the worker's asyncio loop (the handlers' loop), so enter/exit/close need no lock. A refused
call is retryable by design: it has done nothing, and the router sends it to another worker (UNAVAILABLE before
any token) or, for a Prefill, the decode worker reports ABORTED and the router retries with another prefill worker.
Health, GetLoad, Abort and the KV transports' RPCs are not gated: a draining worker still answers them, and the
requests it holds still receive their KV.
"""

from __future__ import annotations

import asyncio
import time


class RequestGate:
    def __init__(self) -> None:
        self.num_in_flight = 0
        self.draining = False
        self._idle: asyncio.Event | None = None  # created on the loop by wait_idle

    def enter(self) -> bool:
        """Admit one call (True), or refuse it because the worker drains (False). Each True needs one exit()."""
        if self.draining:
            return False
        self.num_in_flight += 1
        return True

    def exit(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()

    def close(self) -> None:
        """Refuse every call from now on. Idempotent; there is no reopening (a drained worker is stopped)."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> int:
        """Close the gate and wait up to `timeout_s` for the admitted calls to end; the number still in flight."""
        self.close()
        if self.num_in_flight == 0:
            return 0
        if self._idle is None:
            self._idle = asyncio.Event()
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and (remaining_s := deadline - time.monotonic()) > 0:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), remaining_s)
            except asyncio.TimeoutError:
                break
        return self.num_in_flight
