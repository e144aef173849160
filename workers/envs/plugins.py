"""Environments written for other frameworks, by dotted path.

- Our own interface: `kind: package.module:MyEnvironment` (an `Environment` subclass);
  the registry resolves it directly.
- `kind: nemo_rl`: a NeMo-RL-style environment, a class with a batch
  `step(message_log_batch, metadata) -> (observations, metadata, next_stop_strings,
  rewards, terminateds, ...)`, called in-process without Ray (a `@ray.remote` class is
  unwrapped to the plain class). It judges the finished conversation: one `step` with a
  batch of one at `verify`; `terminateds` says whether the episode reached a terminal
  state. (Multi-turn NeMo-RL games that answer every plain-text turn with an observation
  need the runner to call the environment on turns without tool calls; not supported.)
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
from workers.envs.base import Environment, EnvSession, EpisodeRecord, Verification
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

    def __init__(self, env: "_PluginEnvironment", task: Task):
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
        cls = unwrap_ray(_import(name, "cls", self.options.cls))
        self.impl = cls(self.options.config) if self.options.config is not None else cls()

    async def score(self, task: Task, episode: EpisodeRecord) -> tuple[float, bool, dict[str, Any]]:
        log = [{"role": m["role"], "content": m.get("content") or ""} for m in episode.messages]
        returned = await call_maybe_async(self.impl.step, [log], [dict(task.metadata)])
        observations, _metadata, _stops, rewards, terminateds = tuple(returned)[:5]
        observation = observations[0] if observations else {}
        components = {"observation": str(observation.get("content", ""))[:2000] if isinstance(observation, dict) else ""}
        return float(_first(rewards)), bool(_first(terminateds)), components


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
