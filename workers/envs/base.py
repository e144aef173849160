"""The environment interface every kind implements (local verifiers, NeMo Gym,
OpenReward, plugins).

An `Environment` is built once per worker process for one configured environment
(it holds connection pools and settings). `start(task)` opens an `EnvSession` for
one episode: the initial chat messages and tools, then `step` per turn with the
model's tool calls, `verify` at the end, `close` always.

Messages are plain chat dicts as the tokenizer's chat template takes them:
`{"role": "tool", "content": "...", "tool_call_id": "...", "name": "..."}` for
tool output, `{"role": "user", "content": "..."}` for an env's free-text reply.
"""

from __future__ import annotations

import abc
import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, Union

import msgspec

from pipeline.aio import wait_for
from pipeline.config import EnvConfig
from pipeline.schema import Sample, Status, Task
from workers.errors import OutsideFault

Message = dict[str, Any]


class ToolCall(msgspec.Struct, kw_only=True):
    """One tool call parsed from the model's text of a turn."""

    id: str
    name: str
    arguments: dict[str, Any]


class StepResult(msgspec.Struct, kw_only=True):
    messages: list[Message]  # observations to append (role tool / user)
    reward: Union[float, None] = None  # optional per-step reward
    done: bool = False  # the environment reached a terminal state


class Verification(msgspec.Struct, kw_only=True):
    reward: float
    components: dict[str, Any] = {}
    # Set by environments that judge termination themselves and shape their reward with
    # `rewards.shape_reward` (nonterminal_reward folded into the reduction, then clamp).
    # None: the runner applies `nonterminal_reward` from its own view (a step said done).
    terminal: Union[bool, None] = None


class EpisodeRecord(msgspec.Struct, kw_only=True):
    """What `verify` sees of a finished episode (text level; tokens stay with the runner)."""

    task: Task
    messages: list[Message]  # full conversation: initial, assistant turns (with tool_calls), observations
    response_text: str  # the assistant's text over all turns, concatenated
    step_rewards: list[float] = []
    finished: bool = False  # an environment step returned done=True
    status: Status = Status.COMPLETED
    turns: int = 0


class EnvError(RuntimeError):
    """An environment call failed for good (after its retry budget); the episode is failed.

    The message names the environment call and the last cause; it goes into the failed
    sample's metadata, so it never contains secrets.
    """


class MeasurementFailed(EnvError, OutsideFault):
    """A verifier ran and could not decide: its own timeout, recursion limit or an error inside it
    (math-verify giving up on a 200-deep fraction). Never a 0 to train on: the episode fails with
    this reason (removed from the loss, counted with the failed episodes), like an outage, but
    retrying it does not help: the rm-server answers 422, not 503. A checker process that crashed
    or was killed is one (`workers.envs.checkers`)."""


class Undecided(MeasurementFailed):
    """The verifier's budget ran out on the answer itself: math-verify's timeout, its parser's
    recursion or memory limit, an error inside it on this answer (`\\boxed{9^{9^{9^{9}}}}`). Such an
    answer is wrong or adversarial, so by default it scores 0 with its reason, counted apart as
    `undecided` (`EnvConfig.on_undecided: zero`; `remove` makes it a failed measurement):
    removing it would give it no negative advantage, and a policy would learn that a
    pathological answer costs nothing (`workers.envs.rewards.settle_undecided`). `answer` is the
    text the verifier was asked to read, whole (the components cap it); an attribute, so it
    survives the pickle back from a checker process."""

    def __init__(self, reason: str, answer: Union[str, None] = None):
        super().__init__(reason)
        self.answer = answer


class TaskUngradable(MeasurementFailed):
    """The task's gold cannot be read by the verifier (math-verify parses nothing from the
    label): no answer could score 1. `rollout prepare` rejects such a row where it can
    (`workers.validate`); a task that slips through fails every episode with this reason (its
    samples removed, the task named in the log) and the rm-server answers 400 (the caller's
    label)."""


class EnvSession(abc.ABC):
    """One episode's view of an environment."""

    messages: list[Message]
    tools: list[dict[str, Any]]  # OpenAI function-tool schemas for the chat template

    @abc.abstractmethod
    async def step(self, calls: list[ToolCall]) -> StepResult:
        """Run the model's tool calls; return observations, an optional step reward, done."""

    @abc.abstractmethod
    async def verify(self, episode: EpisodeRecord) -> Verification:
        """Score the finished episode."""

    def episode_done(self, sample: Sample, episode_id: str, run: str) -> None:
        """The finished episode's sample (as it will be trained), before `close`; `run` names the
        pipeline run (the Redis namespace). For environments that watch their episodes
        (OpenReward's trajectory upload): it runs on the worker's event loop, so it must return at
        once (hand any I/O to a thread) and must not change the sample."""

    async def close(self) -> None:
        """Release per-episode resources (sessions, cookies). Always called."""


class Environment(abc.ABC):
    """One configured environment in one worker process."""

    def __init__(self, name: str, config: EnvConfig):
        self.name = name
        self.config = config

    @abc.abstractmethod
    async def start(self, task: Task) -> EnvSession:
        """Open a session for one episode of `task`."""

    async def aclose(self) -> None:
        """Release process-wide resources (HTTP sessions, pools)."""


SessionT = TypeVar("SessionT", bound=EnvSession)


async def opened(session: SessionT, opening: Callable[[], Awaitable[None]]) -> SessionT:
    """`session` once `opening()` succeeded; closed again if it failed, so that a session whose
    seeding failed halfway (a server-side session, an HTTP connection) never leaks."""
    try:
        await opening()
    except BaseException:
        await session.close()
        raise
    return session


T = TypeVar("T")


async def call_once(
    fn: Callable[[], Awaitable[T]],
    budget: Any,
    what: str,
    *,
    unsent: Callable[[BaseException], bool],
) -> T:
    """Run a call that must not run twice (a tool call) at most once.

    `rewards.call_with_budget` retries transient failures, which is right for idempotent
    calls (seeding, verification) and wrong for a tool: a timeout or a dropped answer does
    not say whether the server ran it. Here only failures that `unsent(exc)` says happened
    before the request left this process (a refused connection, a connect timeout) are
    retried, within `budget.retries` with full-jitter backoff (`budget.backoff_s`); when
    they are spent, `EnvError` (nothing ran: the environment is unreachable). Any other
    outcome goes back to the caller: the answer, its exception, or `asyncio.TimeoutError`
    after `budget.timeout_s`, and the caller must not send the call again (it tells the
    model, or fails the episode).
    """
    failures: list[BaseException] = []
    for attempt in range(budget.retries + 1):
        try:
            return await wait_for(fn(), budget.timeout_s)
        except Exception as exc:  # noqa: BLE001 - classified by `unsent`
            if not unsent(exc):
                raise
            failures.append(exc)
        if attempt < budget.retries:
            await asyncio.sleep(random.uniform(0.0, budget.backoff_s * (2**attempt)))
    last = failures[-1]
    raise EnvError(f"{what}: not sent after {len(failures)} attempt(s); last error: {type(last).__name__}: {last}"[:600])
