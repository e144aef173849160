"""Pool children for tests/workers/test_worker_jobs.py, in a module with no heavy imports: a spawned
child imports it before running, and a slow import on a loaded machine would let SIGTERM
reach a child before it installed its handler."""

from __future__ import annotations

import time


def child_exit(code: int, after_s: float = 0.0) -> None:
    """A pool child that exits with `code` (after `after_s`)."""
    import os as _os

    time.sleep(after_s)
    _os._exit(code)


def child_drains(_unused: int = 0) -> None:
    """A pool child that runs until SIGTERM, then exits 0 (drained)."""
    import signal as _signal
    import sys as _sys

    _signal.signal(_signal.SIGTERM, lambda *_: _sys.exit(0))
    while True:
        time.sleep(0.05)


def child_ignores_sigterm(_unused: int = 0) -> None:
    """A pool child stuck in its drain: SIGTERM does nothing."""
    import signal as _signal

    _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
    while True:
        time.sleep(0.05)
