"""Environments written for other frameworks, by dotted path.

- Our own interface: `kind: package.module:MyEnvironment` (an `Environment` subclass);
  the registry resolves it directly.
- `kind: nemo_rl`: a NeMo-RL-style environment, a class with a batch
  `step(message_log_batch, metadata) -> (observations, metadata, next_stop_strings,
  rewards, terminateds, ...)`, called in-process without Ray (a `@ray.remote` class is
  unwrapped to the plain class). By default it judges the finished conversation: one
  `step` with a batch of one at `verify`; `terminateds` says whether the episode reached a
  terminal state. With `multi_turn: true` it runs NeMo-RL's rollout loop (`NemoRLSession`):
  `step` after every assistant turn, batched across the worker's concurrent episodes
  (`StepBatcher`), observations as raw content tokens, `next_stop_strings` as SGLang `stop`;
  `ray: true` runs the class as a Ray actor (`RayActor`).
- `kind: slime_rm`: a slime custom reward function `async def rm(args, sample) -> float`
  (`--custom-rm-path` style; a plain function works too) as the verifier. `sample` is
  slime's `Sample` when slime is importable, else `pipeline.slime.LocalSample` with the
  same field names; `args` is a namespace built from `options.args`.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from types import SimpleNamespace
from typing import Any, Union

from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import Environment, EnvSession, EpisodeRecord, StepResult, Verification
from workers.envs.options import Options, parse_options
from workers.envs.rewards import call_with_budget, deadline_in, shaped
from workers.envs.toolless import ToollessSession
from workers.plugins import import_dotted


async def call_maybe_async(fn: Any, *args: Any) -> Any:
    """Await a coroutine function; run a plain one in a thread (it may block on I/O or CPU)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


def _import(name: str, key: str, target: str) -> Any:
    try:
        return import_dotted(target)
    except ValueError as exc:
        raise ConfigError(f"environments.{name}.options.{key}: {exc}") from exc


class _VerifierSession(ToollessSession):
    """No tools; the plugin scores the finished episode."""

    def __init__(self, env: _PluginEnvironment, task: Task):
        super().__init__(task)
        self.env = env

    async def verify(self, episode: EpisodeRecord) -> Verification:
        timeouts = self.env.config.timeouts
        reward, terminal, components = await call_with_budget(
            lambda: self.env.score(self.task, episode),
            timeouts.verify,
            f"{self.env.config.kind} env {self.env.name!r}: verify",
            deadline=deadline_in(timeouts.verify_deadline_s),
        )
        return shaped(self.env.config, [reward], terminal=terminal, components=components)


class _PluginEnvironment(Environment):
    """A plugin that only scores finished episodes: (reward, terminal, components)."""

    async def start(self, task: Task) -> EnvSession:
        return _VerifierSession(self, task)

    @abc.abstractmethod
    async def score(self, task: Task, episode: EpisodeRecord) -> tuple[float, bool, dict[str, Any]]:
        """Score one finished episode of `task`."""


# ------------------------------------------------------------------ NeMo-RL


class NemoRLOptions(Options):
    cls: str  # dotted path of the environment class
    config: Union[dict[str, Any], None] = None  # passed as the constructor's single argument (NeMo-RL cfg)
    # true: NeMo-RL's rollout loop, `step` after every assistant turn (games); false: one `step` at verify
    multi_turn: bool = False
    stop_strings: Union[list[str], None] = None  # the first turn's stop strings (later turns: next_stop_strings)
    # multi_turn: steps of a worker's concurrent episodes go to `step` as one batch; a step waits at
    # most batch_wait_s for others to join (0: only those issued in the same event-loop pass)
    batch_wait_s: float = 0.005
    max_batch: int = 64
    # run the class as a Ray actor (a `@ray.remote` class as it is, a plain one wrapped), starting
    # Ray in the worker when it is not running (`ray_init`: ray.init's keyword arguments)
    ray: bool = False
    ray_init: dict[str, Any] = {}


def unwrap_ray(cls: Any) -> Any:
    """The plain class behind a `@ray.remote` actor class (ActorClass keeps it in its metadata)."""
    metadata = getattr(cls, "__ray_metadata__", None)
    return getattr(metadata, "modified_class", None) or getattr(cls, "__ray_actor_class__", None) or cls


def _first(values: Any) -> Any:
    value = values[0]
    return value.item() if hasattr(value, "item") else value


class NemoRLEnvironment(_PluginEnvironment):
    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, NemoRLOptions)
        target = _import(name, "cls", self.options.cls)
        if self.options.ray:
            self.impl: Any = RayActor(target, self.options.config, self.options.ray_init)
        else:
            cls = unwrap_ray(target)
            self.impl = cls(self.options.config) if self.options.config is not None else cls()
        self.batcher = StepBatcher(self.impl, self.options.batch_wait_s, self.options.max_batch)

    async def aclose(self) -> None:
        if isinstance(self.impl, RayActor):
            self.impl.kill()

    async def start(self, task: Task) -> EnvSession:
        if self.options.multi_turn:
            return NemoRLSession(self, task)
        return await super().start(task)

    async def score(self, task: Task, episode: EpisodeRecord) -> tuple[float, bool, dict[str, Any]]:
        log = [{"role": m["role"], "content": m.get("content") or ""} for m in episode.messages]
        returned = await call_maybe_async(self.impl.step, [log], [dict(task.metadata)])
        observations, _metadata, _stops, rewards, terminateds = tuple(returned)[:5]
        observation = observations[0] if observations else {}
        components = {"observation": str(observation.get("content", ""))[:2000] if isinstance(observation, dict) else ""}
        return float(_first(rewards)), bool(_first(terminateds)), components


class RayActor:
    """A NeMo-RL environment as a Ray actor; `step` awaits the actor's answer (an ObjectRef)."""

    def __init__(self, cls: Any, config: Any, ray_init: dict[str, Any]):
        import os
        import sys

        import ray

        if not ray.is_initialized():
            # the actor's process must import the class as this process does
            path = os.pathsep.join(p for p in sys.path if p)
            runtime_env = {"env_vars": {"PYTHONPATH": path}}
            ray.init(**{"runtime_env": runtime_env, "include_dashboard": False, "log_to_driver": False, **ray_init})
        remote = cls if hasattr(cls, "remote") else ray.remote(cls)
        self.actor = remote.remote(config) if config is not None else remote.remote()

    async def step(self, message_logs: list, metadata: list) -> Any:
        return await self.actor.step.remote(message_logs, metadata)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


def _at(values: Any, i: int) -> Any:
    value = values[i]
    return value.item() if hasattr(value, "item") else value


def _reward_at(rewards: Any, i: int) -> float:
    """Sample i's reward: a tensor/list, or NeMo-RL's multi-reward dict of them (summed, as its rollout does)."""
    if isinstance(rewards, dict):
        return float(sum(_at(v, i) for v in rewards.values()))
    return float(_at(rewards, i))


class StepBatcher:
    """Batches concurrent episodes' `step` calls into one batch `step(message_logs, metadata)`.

    A step waits at most `wait_s` for others (or until `max_batch` are pending); the batch runs
    in a thread (NeMo-RL environments are synchronous). Counted: `batches`, `steps`, `max_size`.
    """

    def __init__(self, impl: Any, wait_s: float, max_batch: int):
        self.impl, self.wait_s, self.max_batch = impl, wait_s, max(1, max_batch)
        self.pending: list[tuple[Any, Any, asyncio.Future]] = []
        self.timer: Union[asyncio.TimerHandle, None] = None
        self.batches = self.steps = self.max_size = 0

    async def step(self, log: list[dict[str, Any]], metadata: Any) -> tuple[Any, ...]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.pending.append((log, metadata, future))
        if len(self.pending) >= self.max_batch:
            self._flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            asyncio.ensure_future(self._run(batch))

    async def _run(self, batch: list[tuple[Any, Any, asyncio.Future]]) -> None:
        self.batches += 1
        self.steps += len(batch)
        self.max_size = max(self.max_size, len(batch))
        try:
            returned = tuple(await call_maybe_async(self.impl.step, [b[0] for b in batch], [b[1] for b in batch]))
            observations, metadata, stops, rewards, terminateds = returned[:5]
            answers = returned[5] if len(returned) > 5 else None
            results = [
                (observations[i], metadata[i] if metadata else None, stops[i] if stops else None,
                 _reward_at(rewards, i), bool(_at(terminateds, i)), answers[i] if answers else None)
                for i in range(len(batch))
            ]
        except Exception as exc:  # noqa: BLE001 - every episode of the batch gets the failure
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, _, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)


class NemoRLSession(ToollessSession):
    """NeMo-RL's multi-turn loop for one episode: after every assistant turn, `step([log], [metadata])`.

    The log is NeMo-RL's message log (role/content dicts: the prompt, each assistant turn's whole
    text, each observation with its role, e.g. `environment`); the returned metadata is the next
    turn's (the game state); `next_stop_strings[0]` bounds the next turn (SGLang `stop`);
    `terminateds[0]` ends the episode; the rewards of all steps are summed (NeMo-RL's
    `total_rewards`, `reward_reduction: sum`). Observations are appended as NeMo-RL appends them:
    the content's own tokens, no chat template (`raw_observations`), loss mask 0.
    """

    raw_observations = True

    def __init__(self, env: NemoRLEnvironment, task: Task):
        super().__init__(task)
        self.env = env
        self.log: list[dict[str, Any]] = [{"role": m["role"], "content": m.get("content") or ""} for m in self.messages]
        self.metadata: Any = dict(task.metadata)
        self.next_stop_strings: Union[list[str], None] = env.options.stop_strings
        self.rewards: list[float] = []
        self.terminated = False
        self.answers: list[Any] = []

    async def step_text(self, message: dict[str, Any]) -> StepResult:
        self.log.append({"role": "assistant", "content": str(message.get("content") or "")})
        observation, metadata, stops, reward, terminated, answer = await asyncio.wait_for(
            self.env.batcher.step(list(self.log), self.metadata), self.env.config.timeouts.step.timeout_s
        )
        observation = dict(observation) if observation else {"role": "environment", "content": ""}
        self.log.append(observation)
        if metadata is not None:  # NeMo-RL clears it when a game ends
            self.metadata = metadata
        self.next_stop_strings = list(stops) if stops is not None else None
        self.rewards.append(reward)
        self.terminated = terminated
        if answer is not None:
            self.answers.append(answer)
        message_out = {"role": str(observation.get("role", "environment")), "content": str(observation.get("content", ""))}
        return StepResult(messages=[message_out], reward=reward, done=self.terminated)

    async def verify(self, episode: EpisodeRecord) -> Verification:
        batcher = self.env.batcher
        components: dict[str, Any] = {"steps": len(self.rewards), "step_batches": batcher.batches,
                                      "max_step_batch": batcher.max_size}
        if self.answers:
            components["answer"] = str(self.answers[-1])[:200]
        return shaped(self.env.config, self.rewards, terminal=self.terminated, components=components)


# ------------------------------------------------------------------ slime reward function


class SlimeRMOptions(Options):
    function: str  # dotted path of `async def rm(args, sample)`
    args: dict[str, Any] = {}  # attributes of the `args` namespace it receives
    reward_key: Union[str, None] = None  # when rm returns a dict: the entry that is the reward


def slime_sample(task: Task, episode: EpisodeRecord) -> Any:
    """The episode as slime's Sample (or LocalSample): prompt, response, label, metadata, status."""
    from pipeline.slime import SampleClass

    return SampleClass(
        prompt=task.prompt,
        response=episode.response_text,
        label=task.label,
        metadata=dict(task.metadata),
        status=SampleClass.Status[episode.status.name],
    )


class SlimeRMEnvironment(_PluginEnvironment):
    def __init__(self, name: str, config: EnvConfig):
        super().__init__(name, config)
        self.options = parse_options(name, config, SlimeRMOptions)
        self.rm = _import(name, "function", self.options.function)
        if not callable(self.rm):
            raise ConfigError(f"environments.{name}.options.function: {self.options.function!r} is not callable")
        self.args = SimpleNamespace(**self.options.args)

    async def score(self, task: Task, episode: EpisodeRecord) -> tuple[float, bool, dict[str, Any]]:
        result = await call_maybe_async(self.rm, self.args, slime_sample(task, episode))
        components: dict[str, Any] = {}
        if isinstance(result, dict):
            components = {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool))}
            result = result[self.options.reward_key or "reward"]
        return float(result), episode.status == Status.COMPLETED, components
