"""Per-environment reward handling and bounded environment calls, in one place.

Rewards (OpenReward's train_config.yaml semantics):

- `reduce_rewards`: step rewards -> one number with `reward_reduction` (sum/mean/max/min).
- `shape_reward`: what an environment with its own notion of "terminal" returns from
  `verify`: append `nonterminal_reward` to the rewards when the episode never reached
  a terminal state, reduce, clamp to `min_reward`/`max_reward`. Such a `Verification`
  carries `terminal=` so the runner does not apply the nonterminal reward twice.
- `final_reward`: what the episode runner applies to every verification: for
  environments that left `terminal` unset, `nonterminal_reward` replaces the reward
  when no step said done; then the clamp (idempotent for shaped rewards).

Calls (every call to an environment server or sandbox):

- `call_with_budget`: a per-call timeout and a retry budget with jittered exponential
  backoff for transient failures (unreachable, 5xx, timeout), optionally bounded by an
  aggregate `deadline` (loop time) such as one episode's verification deadline. When the
  budget is spent it raises `EnvError` naming the call and the last cause.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, Union

import aiohttp

from pipeline.aio import wait_for
from pipeline.config import CallBudget, EnvConfig
from workers.envs.base import EnvError, Undecided, Verification

log = logging.getLogger(__name__)

T = TypeVar("T")

# A component string's cap: the components travel with every sample (Redis, the trainer's batch).
MAX_COMPONENT_CHARS = 200


def capped(text: str) -> str:
    """`text`, or its first MAX_COMPONENT_CHARS characters and "..." when longer."""
    return text if len(text) <= MAX_COMPONENT_CHARS else text[:MAX_COMPONENT_CHARS] + "..."

_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "mean": lambda xs: sum(xs) / len(xs),
    "max": max,
    "min": min,
}


def reduce_rewards(config: EnvConfig, rewards: Sequence[float]) -> float:
    """Step rewards -> one number; no rewards -> 0.0."""
    if not rewards:
        return 0.0
    return float(_REDUCERS[config.reward_reduction](list(rewards)))


def clamp_reward(config: EnvConfig, reward: float) -> float:
    if config.min_reward is not None:
        reward = max(reward, config.min_reward)
    if config.max_reward is not None:
        reward = min(reward, config.max_reward)
    return float(reward)


def shape_reward(config: EnvConfig, rewards: Sequence[float], *, terminal: bool) -> float:
    """OpenReward semantics: nonterminal reward appended when not terminal, reduce, clamp."""
    values = list(rewards)
    if not terminal and config.nonterminal_reward is not None:
        values.append(config.nonterminal_reward)
    return clamp_reward(config, reduce_rewards(config, values))


def shaped(config: EnvConfig, rewards: Sequence[float], *, terminal: bool, components: dict) -> Verification:
    """A `Verification` whose reward is already shaped; the unshaped rewards go into the components."""
    return Verification(
        reward=shape_reward(config, rewards, terminal=terminal),
        terminal=terminal,
        components={**components, "rewards": list(rewards), "terminal": terminal},
    )


def settle_undecided(config: EnvConfig, undecided: Undecided, *, terminal: bool, components: dict) -> Verification:
    """An answer the verifier gave up on, per the environment's `on_undecided`: `zero` (the
    default) scores it 0 with its reason and `undecided: True` in the components (counted apart
    per environment); `remove` raises it back (a failed measurement: no loss). Zero, because a
    removed sample gets no negative advantage: a policy that cannot solve a task would learn that
    a pathological answer (`\\boxed{9^{9^{9^{9}}}}`) costs nothing. The answer it gave up on goes
    into the components capped (`capped`): such an answer is as long as the model made it."""
    if config.on_undecided == "remove":
        raise undecided
    answer = None if undecided.answer is None else capped(undecided.answer)
    return shaped(config, [0.0], terminal=terminal, components={
        **components, "answer": answer, "correct": False, "undecided": True, "reason": str(undecided)})


def final_reward(config: EnvConfig, verification: Union[Verification, float], *, finished: bool) -> float:
    """The runner's last word on an episode's reward."""
    if isinstance(verification, Verification):
        if verification.terminal is not None:  # shaped by the environment already
            return clamp_reward(config, verification.reward)
        reward = verification.reward
    else:
        reward = verification
    if not finished and config.nonterminal_reward is not None:
        reward = config.nonterminal_reward
    return clamp_reward(config, reward)


# ------------------------------------------------------------------ bounded calls


class TransientError(Exception):
    """A failure worth retrying (a 5xx answer, a dropped connection)."""


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (TransientError, asyncio.TimeoutError, aiohttp.ClientConnectionError, ConnectionError)):
        return True
    return isinstance(exc, aiohttp.ClientResponseError) and exc.status >= 500


def _backoff(budget: CallBudget, attempt: int) -> float:
    """Full jitter: uniform in [0, backoff * 2**attempt], so retries of many episodes spread out."""
    return random.uniform(0.0, budget.backoff_s * (2**attempt))


async def call_with_budget(
    fn: Callable[[], Awaitable[T]],
    budget: CallBudget,
    what: str,
    *,
    deadline: Union[float, None] = None,
) -> T:
    """Run `fn()` with `budget.timeout_s` per attempt and up to `budget.retries` retries.

    Only transient failures are retried; any other exception is raised as `EnvError`
    at once. `deadline` (event-loop time) bounds all attempts and backoffs together.
    """
    loop = asyncio.get_running_loop()
    failures: list[BaseException] = []
    for attempt in range(budget.retries + 1):
        timeout = budget.timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - loop.time())
            if timeout <= 0:
                raise EnvError(f"{what}: deadline passed after {attempt} attempt(s){_history(failures)}")
        try:
            return await wait_for(fn(), timeout)
        except EnvError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_transient(exc):
                raise EnvError(f"{what}: {_describe(exc)}") from exc
            failures.append(exc)
        if attempt < budget.retries:
            pause = _backoff(budget, attempt)
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - loop.time()))
            log.debug("%s: attempt %d failed (%s); retrying in %.2fs", what, attempt + 1, _describe(failures[-1]), pause)
            await asyncio.sleep(pause)
    raise EnvError(f"{what}: failed {budget.retries + 1} time(s){_history(failures)}")


def deadline_in(seconds: float) -> float:
    """An aggregate deadline `seconds` from now, in event-loop time (for `call_with_budget`)."""
    return asyncio.get_running_loop().time() + seconds


def _history(failures: list[BaseException]) -> str:
    """'; last error: X' plus the distinct earlier errors, so a failure whose attempts met
    different faults (a refused connection, then 5xx) tells the whole story, not the last line."""
    if not failures:
        return ""
    last = _describe(failures[-1])
    earlier = [text for text in dict.fromkeys(_describe(exc) for exc in failures[:-1]) if text != last]
    return f"; last error: {last}" + (f" (earlier: {' | '.join(earlier)})" if earlier else "")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]
