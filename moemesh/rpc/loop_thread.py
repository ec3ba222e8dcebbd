"""`LoopThread`: an asyncio event loop running in a daemon thread, for sync callers of aio code.

The engine is synchronous; gRPC aio stubs need a loop. `LoopThread.submit(coro)` schedules a
coroutine on the loop and returns a `concurrent.futures.Future` at once.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed (cheaper wake-ups from other threads), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    def __init__(self, name: str = "moemesh-loop"):
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        if self.loop.is_closed() or not self.thread.is_alive():
            coro.close()
            raise RuntimeError("LoopThread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result."""
        return self.submit(coro).result(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what is still pending, stop the loop, join the thread."""
        if not self.thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.loop.close()

    def __enter__(self) -> "LoopThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
