"""CPU-bound answer checking off the event loop, shared by the math and nemo_skills kinds.

A process pool started on first use with `spawn`: the worker process has threads (event loop
helpers, SDK pings) whose locks fork would copy, and spawn passes sys.path to the children. A
checker that dies (OOM-killed, a parser's C stack) fails that verification as a failed
measurement (`MeasurementFailed`: removed from the loss; the rm-server's 422) and the next call
starts a fresh pool.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from workers.envs.base import MeasurementFailed

T = TypeVar("T")


class CheckerPool:
    def __init__(self, processes: int, what: str):
        self.processes = processes
        self.what = what  # names the environment in errors
        self._pool: ProcessPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.processes, mp_context=multiprocessing.get_context("spawn"))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except BrokenProcessPool as exc:
            self._pool = None
            raise MeasurementFailed(f"{self.what}: checker process died (crashed or killed)") from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
