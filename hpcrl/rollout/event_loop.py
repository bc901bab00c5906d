"""The rollout's asyncio event loop, running in a thread of its own so that a rollout can run while the
trainer trains (async mode); the rollout manager's verbs submit their coroutines to it and wait."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine


class EventLoopThread:
    """An asyncio event loop running forever in a daemon thread, started at construction.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "hpcrl-rollout-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop and return at once: the future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Cancel what still runs on the loop (a rollout the trainer no longer waits for; up to 30 s), stop
        the loop, join the thread (up to 30 s) and close the loop once the thread has ended."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=30)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()
