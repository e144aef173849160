"""The worker process pool (workers/pool.py): a stop signal reaches every child, also one that
was being started when the signal came."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from typing import Any

from tests.workers.test_worker_jobs import _pool, _run_pool

SETTLE_S = 1.5  # a spawned child imports tests.support.pool_children and installs its handler in this


class SignalledWhileStarting:
    """The spawn context, except that the parent gets SIGTERM while the `nth` child starts:
    the child exists (it has a pid) and `Pool._spawn` has not returned yet, which is where an
    operator's SIGTERM lands when it meets a start or a restart."""

    def __init__(self, nth: int):
        self.ctx = mp.get_context("spawn")
        self.nth = nth
        self.started = 0

    def Process(self, **kwargs: Any) -> mp.process.BaseProcess:  # noqa: N802 - multiprocessing's name
        proc = self.ctx.Process(**kwargs)
        start = proc.start

        def start_then_signal() -> None:
            del proc.start  # the Process object is pickled for the child: no closure in it
            start()
            self.started += 1
            if self.started == self.nth:
                time.sleep(SETTLE_S)  # the child is running its drain handler by now
                signal.raise_signal(signal.SIGTERM)  # the pool's handler runs here, inside start()

        proc.start = start_then_signal  # type: ignore[method-assign]
        return proc


def test_a_sigterm_during_a_spawn_drains_the_new_child_too():
    from tests.support.pool_children import child_drains

    kill_after_s = 8.0
    pool = _pool(child_drains, 0, processes=2, kill_after_s=kill_after_s)
    pool.ctx = SignalledWhileStarting(nth=2)
    status, seconds = _run_pool(pool, timeout=40)
    codes = [p.exitcode for p in pool.children if p is not None]
    assert len(codes) == 2 and -signal.SIGKILL not in codes, codes  # before: the second one SIGKILLed
    assert all(code in (0, -signal.SIGTERM) for code in codes), codes
    assert status == 0 and seconds < kill_after_s - 2, seconds
