"""The engine on its own thread, so gRPC handlers can feed it and read from it.

    handler threads ──call(fn)──▶ command queue ──▶ loop thread: run commands, then engine.step()
                    ◀── listener(output) ◀──────────────────────── every RequestOutput, routed by request id

The engine is single-threaded: everything that changes it (add, abort) runs on the loop thread through `call`,
between steps, under the engine's lock. `call_now` runs a short function on its caller's thread under that lock
instead, which a step lets go of while it computes: a peer's pin of cached blocks, the router's load poll, or a
decode worker's reservation and commit of a handoff need not wait for a long step to end. Listeners are called on
the loop thread (or a `call_now`'s, under the lock) and must not block (hand outputs to a queue). A request's
listener is dropped after its finished output.

The loop sleeps on its wake event (set by every command) when there is nothing to schedule, and also when a step
could schedule nothing (requests waiting for blocks that only a command, an abort or a commit, frees): it never
spins. `progress()` is its heartbeat for liveness checks: alive, and how long the current step has been running.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05
Listener = Callable[[RequestOutput], None]


class EngineLoopClosed(RuntimeError):
    """The loop has stopped; nothing more runs on the engine."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, name: str = "engine-loop") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], object], Future]] = queue.SimpleQueue()
        self._listeners: dict[str, Listener] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._step_started_s: float | None = None  # time.monotonic() at the start of the running step, if any
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort every request, stop the thread. Idempotent."""
        if self._stopped.is_set():
            return
        if self._thread.is_alive():
            try:
                self.call(lambda e: e.abort_all(), timeout_s)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("aborting requests at shutdown failed")
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self._fail_pending()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def step_running_s(self) -> float:
        """How long the step now running has been running; 0 between steps. Read from any thread."""
        started_s = self._step_started_s
        return 0.0 if started_s is None else time.monotonic() - started_s

    # -- talking to the engine -------------------------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], T], timeout_s: float | None = 30.0) -> T:
        """Run `fn(engine)` on the loop thread between steps; return its result or raise its exception."""
        return self.submit(fn).result(timeout_s)

    def call_now(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on this thread under the engine's lock: between steps, or while a step computes, without
        waiting for it to end; then, as after a command, the KV events go out, the outputs `fn` returns go to their
        listeners (before any later step's), and the loop wakes. Only for what leaves the step that computes alone
        (LLMEngine._computing): the block pool, the prefix cache and the staged peer blocks, the engine's stats, a
        decode worker's reservation and commit of a request that no step has run yet; never the requests of the
        step, the runner's inputs or the KV cache's rows they read."""
        if self._stopped.is_set():
            raise EngineLoopClosed("the engine loop has stopped")
        with self.engine.lock:
            result = fn(self.engine)
            self.engine.publish_kv_events()
            self._deliver(result)
        self._wake.set()  # a committed request waits for the next step
        return result

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        if self._stopped.is_set():
            raise EngineLoopClosed("the engine loop has stopped")
        future: Future[T] = Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def listen(self, request_id: str, listener: Listener) -> None:
        """Route `request_id`'s outputs to `listener` (call before the request can produce any)."""
        self._listeners[request_id] = listener

    def unlisten(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._run_commands()
            if self.engine.has_schedulable_requests():
                self._step_started_s = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception:  # the engine already failed the step's requests; keep serving the others
                    logger.exception("engine step raised")
                    continue
                finally:
                    self._step_started_s = None
                self._dispatch(outputs)
                if self.engine.num_scheduled_last_step:
                    continue
            self._wake.wait(_IDLE_WAIT_S)  # nothing ran: until a command (or, as a safety net, a short while)
            self._wake.clear()
        self._fail_pending()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self.engine.lock:
                    result = fn(self.engine)
                    self.engine.publish_kv_events()  # an admission or an abort can evict cached blocks
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
                continue
            # The outputs (e.g. abort_request's final ones) go to the listeners of now, before the caller hears the
            # command ran: a caller that unlistened, aborted and then let a retry of the same id listen must not
            # have the retry's listener handed the aborted attempt's output.
            self._deliver(result)
            future.set_result(result)

    def _deliver(self, result: object) -> None:
        """A command's outputs, if it returned any (one RequestOutput or a list of them), to their listeners."""
        if isinstance(result, list) and result and isinstance(result[0], RequestOutput):
            self._dispatch(result)
        elif isinstance(result, RequestOutput):
            self._dispatch([result])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            listener = self._listeners.get(out.request_id)
            if listener is None:
                continue
            if out.finished:
                self._listeners.pop(out.request_id, None)
            try:
                listener(out)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
                logger.exception("listener for %s raised", out.request_id)

    def _fail_pending(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(EngineLoopClosed("the engine loop has stopped"))
