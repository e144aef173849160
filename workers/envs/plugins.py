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
  `ray: true` runs the class as a Ray actor (`RayActor`); `start_ray: true` starts Ray for an
  in-process class that makes Ray actors of its own (NeMo-Skills' math environment). When the
  class has `global_post_process_and_metrics`, it is called once per group, when the group's
  last episode is scored (`GroupMetrics`), and the metrics go into every sample's components.
- `kind: slime_rm`: a slime custom reward function `async def rm(args, sample) -> float`
  (`--custom-rm-path` style; a plain function works too) as the verifier. `sample` is
  slime's `Sample` when slime is importable, else `pipeline.slime.data_source.LocalSample` with the
  same field names; `args` is a namespace built from `options.args`.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import logging
import math
from types import SimpleNamespace
from typing import Any, Union

import msgspec

from pipeline.aio import wait_for
from pipeline.config import ConfigError, EnvConfig
from pipeline.schema import Status, Task
from workers.envs.base import EnvError, Environment, EnvSession, EpisodeRecord, StepResult, Verification
from workers.envs.options import Options, parse_options
from workers.envs.rewards import call_with_budget, deadline_in, shaped
from workers.envs.toolless import ToollessSession
from workers.plugins import import_dotted

log = logging.getLogger(__name__)

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


class NemoRLOptions(Options, frozen=True):
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
    # in-process (ray: false): start Ray (as for `ray: true`) before building the class, for one
    # whose constructor makes Ray actors of its own (NeMo-Skills' MathEnvironment: HFVerifyWorker)
    start_ray: bool = False
    # the task's label, put into the metadata `step` gets under this key when the row has none
    # (NeMo-Skills' math environment reads `expected_answer`, NeMo-RL's `ground_truth`)
    label_key: Union[str, None] = None
    # call the class's `global_post_process_and_metrics` once per group (see GroupMetrics)
    metrics: bool = True


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
            if self.options.start_ray:
                ensure_ray(self.options.ray_init)
            cls = unwrap_ray(target)
            self.impl = cls(self.options.config) if self.options.config is not None else cls()
        self.batcher = StepBatcher(self.impl, self.options.batch_wait_s, self.options.max_batch)
        wants = self.options.metrics and callable(getattr(self.impl, "global_post_process_and_metrics", None))
        self.metrics: Union[GroupMetrics, None] = GroupMetrics(self) if wants else None

    async def aclose(self) -> None:
        if isinstance(self.impl, RayActor):
            self.impl.kill()
        elif self.options.start_ray and callable(getattr(self.impl, "shutdown", None)):
            await asyncio.to_thread(self.impl.shutdown)  # NeMo-RL's end of run: its worker actors

    def initial_metadata(self, task: Task) -> dict[str, Any]:
        """What `step` gets as the episode's metadata first: the task's, plus the label under `label_key`."""
        metadata = dict(task.metadata)
        key = self.options.label_key
        if key and key not in metadata:
            if task.label is None:
                raise EnvError(f"nemo_rl env {self.name!r}: task {task.id!r} has no label and no metadata.{key} "
                               f"(options.label_key: the answer the environment checks against)")
            metadata[key] = task.label
        return metadata

    async def start(self, task: Task) -> EnvSession:
        self.initial_metadata(task)  # a task without the answer fails its episode here, named
        if self.options.multi_turn:
            return NemoRLSession(self, task)
        return NemoRLVerifierSession(self, task)

    async def score(self, task: Task, episode: EpisodeRecord) -> tuple[float, bool, dict[str, Any]]:
        reward, terminal, components, _entry = await self.score_one(task, episode)
        return reward, terminal, components

    async def score_one(self, task: Task, episode: EpisodeRecord) -> tuple[float, bool, dict[str, Any], MetricsEntry]:
        """One `step` with a batch of one on the finished conversation (single-turn)."""
        log = [{"role": m["role"], "content": m.get("content") or ""} for m in episode.messages]
        metadata = self.initial_metadata(task)
        returned = tuple(await call_maybe_async(self.impl.step, [log], [metadata]))
        observations, next_metadata, _stops, rewards, terminateds = returned[:5]
        answers = returned[5] if len(returned) > 5 else None
        observation = observations[0] if observations else {}
        components: dict[str, Any] = {
            "observation": str(observation.get("content", ""))[:2000] if isinstance(observation, dict) else ""
        }
        answer = answers[0] if answers else None
        if answer is not None:
            components["answer"] = str(answer)[:200]
        reward, terminal = _reward_at(rewards, 0), bool(_first(terminateds))
        log.append(dict(observation) if isinstance(observation, dict) else {"role": "environment", "content": ""})
        entry = MetricsEntry(
            prompt=str(task.prompt), message_log=log, reward=reward, terminated=terminal,
            is_end=episode.status == Status.COMPLETED,
            metadata=next_metadata[0] if next_metadata and next_metadata[0] is not None else metadata,
            answer=answer,
        )
        return reward, terminal, components, entry


class NemoRLVerifierSession(_VerifierSession):
    """Single-turn `kind: nemo_rl`: one `step` at verify, then the group's metrics."""

    def __init__(self, env: NemoRLEnvironment, task: Task):
        super().__init__(env, task)
        self.env: NemoRLEnvironment = env
        self.group = env.metrics.join(task) if env.metrics is not None else None

    async def verify(self, episode: EpisodeRecord) -> Verification:
        timeouts = self.env.config.timeouts
        reward, terminal, components, entry = await call_with_budget(
            lambda: self.env.score_one(self.task, episode),
            timeouts.verify,
            f"nemo_rl env {self.env.name!r}: verify",
            deadline=deadline_in(timeouts.verify_deadline_s),
        )
        if self.group is not None:
            components.update(await self.group.arrive(entry))
            self.group = None
        return shaped(self.env.config, [reward], terminal=terminal, components=components)

    async def close(self) -> None:
        if self.group is not None:  # ended without a score (failed): the group no longer waits for it
            group, self.group = self.group, None
            await group.leave()


def ensure_ray(ray_init: dict[str, Any]) -> Any:
    """Ray, started in this process when it is not running: its workers get this process's
    `sys.path` as PYTHONPATH (an actor must import the class as this process does)."""
    import os
    import sys

    import ray

    if not ray.is_initialized():
        path = os.pathsep.join(p for p in sys.path if p)
        runtime_env = {"env_vars": {"PYTHONPATH": path}}
        ray.init(**{"runtime_env": runtime_env, "include_dashboard": False, "log_to_driver": False, **ray_init})
    return ray


class RayActor:
    """A NeMo-RL environment as a Ray actor; `step` awaits the actor's answer (an ObjectRef)."""

    def __init__(self, cls: Any, config: Any, ray_init: dict[str, Any]):
        ray = ensure_ray(ray_init)
        remote = cls if hasattr(cls, "remote") else ray.remote(cls)
        self.actor = remote.remote(config) if config is not None else remote.remote()
        if hasattr(unwrap_ray(cls), "global_post_process_and_metrics"):
            self.global_post_process_and_metrics = self._metrics

    async def step(self, message_logs: list, metadata: list) -> Any:
        return await self.actor.step.remote(message_logs, metadata)

    async def _metrics(self, batch: Any) -> Any:
        return await self.actor.global_post_process_and_metrics.remote(batch)

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


class MetricsEntry(msgspec.Struct, kw_only=True):
    """One scored episode as NeMo-RL's rollout batch holds it (one row)."""

    prompt: str
    message_log: list[dict[str, Any]]
    reward: float  # the environment's rewards, summed (NeMo-RL's total_reward)
    terminated: bool
    is_end: bool  # the episode ended on its own (status completed), not cut by a length or turn limit
    metadata: Any = None
    answer: Any = None


def rollout_batch(entries: list[MetricsEntry]) -> Any:
    """The group as the batch NeMo-RL's `global_post_process_and_metrics` takes (a BatchedDataDict
    when nemo_rl is importable): `message_log`, `extra_env_info`, `idx`, `total_reward` and
    `rewards` (the environment's summed rewards), `is_end`, `truncated`, `terminated`, `answers`,
    `text` ((B, 1) prompt ids: equal rows for equal prompts, what `calculate_pass_rate_per_prompt`
    compares). `generation_lengths` and `prompt_lengths` are NaN: an environment sees text, the
    tokens stay with the runner (the samples carry them), so metrics made of them are dropped."""
    import torch

    prompts: dict[str, int] = {}
    n = len(entries)
    rewards = torch.tensor([e.reward for e in entries], dtype=torch.float32)
    data = {
        "message_log": [e.message_log for e in entries],
        "extra_env_info": [e.metadata for e in entries],
        "idx": list(range(n)),
        "total_reward": rewards,
        "rewards": rewards.clone(),
        "is_end": torch.tensor([e.is_end for e in entries], dtype=torch.bool),
        "truncated": torch.tensor([not e.is_end for e in entries], dtype=torch.bool),
        "terminated": torch.tensor([e.terminated for e in entries], dtype=torch.bool),
        "answers": [e.answer for e in entries],
        "text": torch.tensor([[prompts.setdefault(e.prompt, len(prompts))] for e in entries], dtype=torch.long),
        "generation_lengths": torch.full((n,), math.nan),
        "prompt_lengths": torch.full((n,), math.nan),
    }
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except ImportError:
        return data
    return BatchedDataDict(data)


def metric_components(metrics: Any, group_size: int) -> dict[str, Any]:
    """`nemo_rl/<name>` for each finite number the environment returned, and the group size."""
    out: dict[str, Any] = {"nemo_rl/group_size": group_size}
    for key, value in dict(metrics or {}).items():
        value = value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[f"nemo_rl/{key}"] = value
    return out


class _Group:
    def __init__(self, owner: GroupMetrics, task: Task):
        self.owner, self.task = owner, task
        self.waiting = 0  # sessions not yet scored or gone
        self.entries: list[MetricsEntry] = []
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()

    async def arrive(self, entry: MetricsEntry) -> dict[str, Any]:
        """This episode's row; the group's metrics once every episode is scored or gone."""
        self.entries.append(entry)
        self._one_less()
        return await asyncio.shield(self.result)

    async def leave(self) -> None:
        self._one_less()

    def _one_less(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.owner.done(self)
            # in a task of its own: a cancelled episode does not strand the others
            asyncio.ensure_future(self._compute())

    async def _compute(self) -> None:
        entries = list(self.entries)
        components: dict[str, Any] = {}
        if entries:
            components = await self.owner.compute(entries)
        if not self.result.done():
            self.result.set_result(components)


class GroupMetrics:
    """NeMo-RL's `global_post_process_and_metrics`, once per group.

    NeMo-RL calls it on a rollout batch once all of its rollouts are done. Here the batch is a
    group: the episodes a job runs of one task (the runner starts them together, with the same
    Task object, before any ends). When the group's last episode is scored (or has failed
    without a score), the scored episodes go to it as one batch (`rollout_batch`); its metrics
    go into every scored sample's components as `nemo_rl/<name>` (a mean over samples of a
    trainer's batch is then the batch's sample-weighted figure). It never changes a reward: a
    failing call leaves `nemo_rl/metrics_error` and a warning. Counted: `groups`, `failures`.
    """

    def __init__(self, env: NemoRLEnvironment):
        self.env = env
        self.open: dict[int, _Group] = {}
        self.groups = self.failures = 0

    def join(self, task: Task) -> _Group:
        group = self.open.get(id(task))
        if group is None or group.task is not task:
            group = self.open[id(task)] = _Group(self, task)
        group.waiting += 1
        return group

    def done(self, group: _Group) -> None:
        if self.open.get(id(group.task)) is group:
            del self.open[id(group.task)]

    async def compute(self, entries: list[MetricsEntry]) -> dict[str, Any]:
        self.groups += 1
        fn = self.env.impl.global_post_process_and_metrics
        try:
            returned = await wait_for(
                call_maybe_async(fn, rollout_batch(entries)), self.env.config.timeouts.verify.timeout_s
            )
            metrics = returned[1] if isinstance(returned, (tuple, list)) else returned
            return metric_components(metrics, len(entries))
        except Exception as exc:  # noqa: BLE001 - metrics never fail an episode or change a reward
            self.failures += 1
            log.warning("nemo_rl env %r: global_post_process_and_metrics failed: %r", self.env.name, exc)
            return {"nemo_rl/group_size": len(entries), "nemo_rl/metrics_error": f"{type(exc).__name__}: {exc}"[:200]}


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
        self.metadata: Any = env.initial_metadata(task)
        self.next_stop_strings: Union[list[str], None] = env.options.stop_strings
        self.rewards: list[float] = []
        self.terminated = False
        self.answers: list[Any] = []
        self.group = env.metrics.join(task) if env.metrics is not None else None

    async def step_text(self, message: dict[str, Any]) -> StepResult:
        self.log.append({"role": "assistant", "content": str(message.get("content") or "")})
        observation, metadata, stops, reward, terminated, answer = await wait_for(
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
        if self.group is not None:
            entry = MetricsEntry(
                prompt=str(self.task.prompt), message_log=list(self.log), reward=float(sum(self.rewards)),
                terminated=self.terminated, is_end=episode.status == Status.COMPLETED, metadata=self.metadata,
                answer=self.answers[-1] if self.answers else None,
            )
            group, self.group = self.group, None
            components.update(await group.arrive(entry))
        return shaped(self.env.config, self.rewards, terminal=self.terminated, components=components)

    async def close(self) -> None:
        if self.group is not None:  # ended without a score (failed): the group no longer waits for it
            group, self.group = self.group, None
            await group.leave()


# ------------------------------------------------------------------ slime reward function


class SlimeRMOptions(Options, frozen=True):
    function: str  # dotted path of `async def rm(args, sample)`
    args: dict[str, Any] = {}  # attributes of the `args` namespace it receives
    reward_key: Union[str, None] = None  # when rm returns a dict: the entry that is the reward


def slime_sample(task: Task, episode: EpisodeRecord) -> Any:
    """The episode as slime's Sample (or LocalSample): prompt, response, label, metadata, status."""
    from pipeline.slime.samples import SampleClass

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
