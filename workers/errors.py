"""Which exceptions are bugs and which are the outside world's faults.

A bug (TypeError in our code or in an in-process environment, KeyError, ...) fails its job
loudly once: retrying it only burns tries. A fault of the outside world is retried or becomes a
failed episode with its reason: a transient one (connection, timeout, HTTP 5xx), and an answer
that does not parse or has the wrong shape (an environment answering garbled JSON, a JSON list
where its protocol has an object): that is the environment's fault, not ours, so its task is
handed back per policy like any failed episode's, never dead-lettered for good as a bug. Used
by the job functions, the episode runner and the in-process mode.
"""

from __future__ import annotations

import asyncio
import json

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, asyncio.TimeoutError, OSError)


class OutsideFault(Exception):
    """Mixed into an error that is the outside world's fault whatever its cause (e.g.
    `workers.envs.answers.MalformedAnswer`, raised from the KeyError that a wrong-shaped answer
    gave): `is_bug` stops at it."""


# Text from outside that did not decode: never our bug (msgspec's DecodeError is no ValueError,
# so it is not a bug in the first place).
FAULT_ERRORS: tuple[type[BaseException], ...] = (OutsideFault, json.JSONDecodeError, UnicodeDecodeError)
BUG_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, AttributeError, NameError, LookupError, ValueError, AssertionError, ArithmeticError,
    NotImplementedError, RecursionError, ImportError, SyntaxError,
)


def is_bug(exc: BaseException) -> bool:
    """A programming error (TypeError in an environment, KeyError, ...), not a transient fault
    (connection, timeout, HTTP 5xx, which the engine and environment clients raise as their own
    RuntimeErrors) nor a malformed answer (`FAULT_ERRORS`): retrying it only burns tries, so it
    fails loudly once."""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 5:  # a wrapper (EnvError from the env call budget) names its cause
        if isinstance(cause, TRANSIENT_ERRORS + FAULT_ERRORS) or type(cause).__module__.split(".")[0] in ("aiohttp", "redis", "httpx"):
            return False
        if isinstance(cause, BUG_ERRORS):
            return True
        cause, seen = cause.__cause__, seen + 1
    return False
