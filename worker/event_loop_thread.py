"""An asyncio event loop on a thread of its own: where a worker's grpc.aio server and its outgoing aio channels
live, so that an open stream costs a coroutine, not a thread.

    EventLoopThread(name)      the loop runs from construction
      .run(coro)               run a coroutine on the loop from any other thread; wait for its result
      .stop()                  stop the loop and join the thread (idempotent); pending tasks are cancelled

Blocking work called from a coroutine (a KV send, a wait on the engine thread) goes to the loop's default
executor, sized here: a handful of such calls at once, not one per stream.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    def __init__(self, name: str, *, num_executor_threads: int = 16) -> None:
        self.loop = asyncio.new_event_loop()
        self._executor = ThreadPoolExecutor(max_workers=num_executor_threads, thread_name_prefix=f"{name}-blocking")
        self.loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = False
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the loop; block the calling thread (never the loop's own) until it is done."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("EventLoopThread.run called from its own loop: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
