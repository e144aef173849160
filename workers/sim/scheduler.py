"""The simulated engine's waiting queue: which queued request gets the next free slot.

SGLang 0.5.23 (srt/managers/schedule_policy.py, scheduler.py), modelled here:
- default (`--schedule-policy fcfs`): first come, first served;
- `--enable-priority-scheduling`: the waiting queue is sorted by (priority x sign, the time the
  request entered it), sign -1 by default (larger `priority` values first) and +1 with
  `--schedule-low-priority-values-first`; a request without `priority` gets the least preferred
  value (`_set_or_validate_priority`: -sys.maxsize - 1, or sys.maxsize when low values go first);
- without it, a request's `priority` is ignored (`--abort-on-priority-when-disabled` is not modelled).
The simulator's slots are this queue (`SimEngine._slot`), from `/generate`'s `priority` or, behind
SGLang's own front (tests/engine_stack.py), the TokenizedGenerateReqInput's.
Not modelled: priority preemption of running requests (`--priority-scheduling-preemption-threshold`)
and the queue-full eviction; a slot here is one running request, not KV memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import sys
from collections.abc import AsyncIterator


class SlotQueue:
    """`slots` concurrent holders; waiters are served FCFS or by (priority, arrival)."""

    def __init__(self, slots: int, *, by_priority: bool = False, low_values_first: bool = False):
        self.free = slots
        self.by_priority = by_priority
        self.sign = 1 if low_values_first else -1
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrival = itertools.count()

    def _key(self, priority: int | None) -> int:
        if not self.by_priority:
            return 0
        if priority is None:  # SGLang's default: the least preferred value
            priority = sys.maxsize if self.sign == 1 else -sys.maxsize - 1
        return self.sign * priority

    @contextlib.asynccontextmanager
    async def slot(self, priority: int | None = None) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int | None) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (self._key(priority), next(self._arrival), granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled: hand the slot on
                self._release()
            else:
                granted.cancel()  # still queued: skipped when its turn comes
            raise

    def _release(self) -> None:
        while self._waiting:
            _key, _n, granted = heapq.heappop(self._waiting)
            if not granted.done():
                granted.set_result(None)  # the slot passes straight to the waiter
                return
        self.free += 1
