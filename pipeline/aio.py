"""asyncio helpers: a private event loop on a daemon thread, so synchronous callers (slime's
rollout manager) can use the asyncio Redis client whether or not they run inside a loop; a
`wait_for` that never swallows a cancel."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "rollout-pipeline-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`asyncio.wait_for` without its race before Python 3.12: when the caller is cancelled just as
    the inner awaitable finishes or times out, that wait_for returns (or raises TimeoutError) and
    the cancel is lost, so a cancelled loop runs on (a producer told to stop admitted its whole
    epoch). `asyncio.timeout` (3.11+, what 3.12's wait_for is built on) counts cancellations and
    hands the caller's on; on 3.10, `asyncio.wait` raises the caller's cancel as it comes."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await awaitable
    inner = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({inner}, timeout=timeout)
    except BaseException:
        inner.cancel()
        raise
    if not done:
        inner.cancel()
        await asyncio.wait({inner})  # let it unwind; a cancel of ours here propagates
        raise asyncio.TimeoutError()
    return inner.result()


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for `event` at most `timeout` seconds; True if it is set. A cancel always propagates."""
    try:
        await wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return event.is_set()
    return True
