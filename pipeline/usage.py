"""How a command reports a usage or configuration error it caught itself: one line on stderr,
exit 2, and under `rollout --debug` (which sets $ROLLOUT_DEBUG for the command and its children)
the traceback first, as scripts/cli.py's boundary does for what reaches it."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

ENV_DEBUG = "ROLLOUT_DEBUG"
EXIT_USAGE = 2


def debug_enabled() -> bool:
    return os.environ.get(ENV_DEBUG, "") not in ("", "0")


def usage_error(command: str, exc: BaseException, *, say: Callable[[str], None] | None = None) -> int:
    """Print `rollout <command>: <exc>` (with `say`, e.g. a rich console, else to stderr), the
    traceback before it under --debug; return the usage exit code."""
    if debug_enabled():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    line = f"rollout {command}: {exc}"
    if say is not None:
        say(line)
    else:
        print(line, file=sys.stderr)
    return EXIT_USAGE
