"""Which exceptions are bugs and which are the outside world's faults.

A bug (TypeError in an environment, KeyError, ...) fails its job loudly once: retrying it only
burns tries. A transient fault (connection, timeout, HTTP 5xx) is retried or becomes a failed
episode with its reason. Used by the job functions, the episode runner and the in-process mode.
"""

from __future__ import annotations

import asyncio

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError)
BUG_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, AttributeError, NameError, LookupError, ValueError, AssertionError, ArithmeticError,
    NotImplementedError, RecursionError, ImportError, SyntaxError,
)


def is_bug(exc: BaseException) -> bool:
    """A programming error (TypeError in an environment, KeyError, ...), not a transient fault
    (connection, timeout, HTTP 5xx, which the engine and environment clients raise as their own
    RuntimeErrors): retrying it only burns tries, so it fails loudly once."""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 5:  # a wrapper (EnvError from the env call budget) names its cause
        if isinstance(cause, TRANSIENT_ERRORS) or type(cause).__module__.split(".")[0] in ("aiohttp", "redis", "httpx"):
            return False
        if isinstance(cause, BUG_ERRORS):
            return True
        cause, seen = cause.__cause__, seen + 1
    return False
