"""What decides a simulated engine's tokens: one interface, two policies.

The engine (workers/sim/core.py) owns the time: its scheduler decides when and which requests
step and how long a step lasts. A `Policy` owns the tokens: for each request it draws a `Draft`,
the answer's ids and log-probs and how the answer ends, and the engine emits the draft's ids one
per step until they run out or an abort cuts them. The two policies:

- `ScriptedPolicy` (workers/sim/scripted.py): regex-answers arithmetic and known tasks, calls
  tools, plays sliding-puzzle moves; seeded by the request's routing key, so a turn resumed
  after an abort continues the same answer. It has no weights to load.
- `TinyLMPolicy` (workers/sim/tinylm.py, `--policy-path`): a tiny causal LM samples the answer at
  the request's own sampling params; a weight load re-draws what the requests in flight have
  not emitted yet (`Policy.redraw`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from workers.sim.config import SimConfig

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request does not say


@dataclass
class Draft:
    """One request's answer as its policy drew it. The scheduler steps through `ids` itself (the
    same list), so a re-draw that replaces its tail in place changes the tokens still to come."""

    ids: list[int]
    log_probs: list[float]
    finish: dict[str, Any]  # SGLang's finish_reason where every id is emitted (an abort says its own)
    max_new_tokens: int | None  # the budget the scheduler reserves KV for (None: the answer's length)
    # the whole answer's length at a fresh turn (the engine's `stats["planned"]`); None where the
    # policy plans no whole answer ahead
    planned: int | None = None
    resumed: bool = False  # the input already holds part of this answer (a turn resumed after an abort)


class Policy(Protocol):
    """What the engine asks of whatever decides its tokens."""

    async def draft(self, input_ids: list[int], routing_key: str, params: dict[str, Any], config: SimConfig) -> Draft:
        """The answer to `input_ids` under SGLang's sampling `params`; `config` is the engine's now
        (a served engine's settings change between requests)."""
        ...

    def weights_refusal(self) -> str | None:
        """Why `/update_weights_from_disk` cannot load weights into this policy; None where it can."""
        ...

    def load(self, path: str) -> None:
        """The weights at `path` replace the policy's (blocking: the engine runs it in a thread)."""
        ...

    async def redraw(self, in_flight: list[tuple[Draft, int]]) -> int:
        """After a load: re-draw, past the tokens each has emitted, the drafts in flight that
        earlier weights drew; returns how many it re-drew."""
        ...
