"""An environment's answer that is not in its protocol: the environment's fault, not ours.

A server answering garbled JSON, a list where its protocol has an object or a reward that is no
number fails the episode with `MalformedAnswer` (the reason names the call and the answer's
start); `workers.errors.is_bug` stops at it, so the task is handed back per `on_failure` like
any failed episode's instead of dead-lettered for good as a bug of ours.
"""

from __future__ import annotations

import json
from typing import Any

from workers.envs.base import EnvError
from workers.errors import OutsideFault


class MalformedAnswer(EnvError, OutsideFault):
    """An environment answered, but not in its protocol (see the module's docstring)."""


def json_answer(text: str, what: str) -> Any:
    """`text` decoded as JSON; `MalformedAnswer` naming `what` and the text's start if it is not."""
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError
        raise MalformedAnswer(f"{what}: answer is not JSON ({exc}): {text[:200]!r}") from exc
