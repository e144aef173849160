"""Plugins by dotted path: our interface, a NeMo-RL-style batch environment, a slime reward
function; the registry; the example config covering every kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest

from pipeline.config import ConfigError, EnvConfig, load_config
from pipeline.schema import Status, Task
from tests.support.env_helpers import run_episodes
from workers.envs.base import Environment, EnvSession, EpisodeRecord, StepResult, ToolCall, Verification
from workers.envs.local import initial_messages
from workers.envs.plugins import NemoRLEnvironment, SlimeRMEnvironment, unwrap_ray
from workers.envs.registry import KINDS, UnknownEnvironmentKind, build_environment, resolve_kind

TASK = Task(id="p1", env="plugin", prompt="What is 6 * 7?", label="42", metadata={"source": "unit"})
EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "example_config.yaml"


# (a) a user class implementing our interface
class LengthEnvironment(Environment):
    """Reward = 1 when the answer is short: a user's own environment."""

    async def start(self, task: Task) -> EnvSession:
        return LengthSession(task)


class LengthSession(EnvSession):
    def __init__(self, task: Task):
        self.messages = initial_messages(task)
        self.tools: list[dict[str, Any]] = []

    async def step(self, calls: list[ToolCall]) -> StepResult:
        return StepResult(messages=[], done=True)

    async def verify(self, episode: EpisodeRecord) -> Verification:
        return Verification(reward=1.0 if len(episode.response_text) < 2000 else 0.0, components={"chars": len(episode.response_text)})


# (b) a NeMo-RL-style environment
class EnvironmentReturn(NamedTuple):  # NeMo-RL's shape
    observations: list[dict[str, str]]
    metadata: list[Any]
    next_stop_strings: list[Any]
    rewards: list[float]
    terminateds: list[bool]
    answers: list[Any]


class NemoRLMath:
    def __init__(self, cfg: dict[str, Any]):
        self.bonus = cfg["bonus"]
        self.batches: list[int] = []

    def step(self, message_log_batch: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        self.batches.append(len(message_log_batch))
        rewards, observations = [], []
        for log, meta in zip(message_log_batch, metadata):
            answer = log[-1]["content"]
            correct = meta["ground_truth"] in answer and log[-1]["role"] == "assistant"
            rewards.append(1.0 + self.bonus if correct else 0.0)
            observations.append({"role": "environment", "content": "correct" if correct else "wrong"})
        n = len(message_log_batch)
        return EnvironmentReturn(observations, metadata, [None] * n, rewards, [True] * n, [None] * n)


class FakeActorClass:  # what @ray.remote returns: the class sits in __ray_metadata__.modified_class
    class __ray_metadata__:
        modified_class = NemoRLMath


# (c) a slime custom reward function
async def slime_rm(args: Any, sample: Any) -> dict[str, Any]:
    correct = f"Answer: {sample.label}" in sample.response
    seen = f"{sample.label}|{sample.prompt}|{sample.metadata}|{sample.status.name}|{sample.reward}"
    return {"score": args.scale * (1.0 if correct else 0.0), "length": float(len(sample.response)), "seen": seen}


def _config(kind: str, **options: Any) -> EnvConfig:
    return msgspec.convert({"kind": kind, "options": options}, EnvConfig)


async def test_user_environment_by_dotted_path_through_the_runner():
    env = build_environment("plugin", EnvConfig(kind="tests.workers.test_env_plugins:LengthEnvironment"))
    [sample] = await run_episodes(env, TASK)
    assert sample.status is Status.COMPLETED and sample.reward == 1.0
    assert sample.reward_components["chars"] > 0


async def test_nemo_rl_environment_without_ray():
    task = Task(id="p2", env="rl", prompt="What is 6 * 7?", metadata={"ground_truth": "42"})
    env = build_environment("rl", _config("nemo_rl", cls="tests.workers.test_env_plugins:NemoRLMath", config={"bonus": 0.5}))
    assert isinstance(env, NemoRLEnvironment)
    [sample] = await run_episodes(env, task)
    assert sample.reward == 1.5 and sample.reward_components["observation"] == "correct"
    assert sample.reward_components["terminal"] is True and env.impl.batches == [1]
    assert unwrap_ray(FakeActorClass) is NemoRLMath


async def test_slime_reward_function_as_verifier():
    config = _config("slime_rm", function="tests.workers.test_env_plugins:slime_rm", args={"scale": 2.0}, reward_key="score")
    env = build_environment("rm", config)
    assert isinstance(env, SlimeRMEnvironment)
    [sample] = await run_episodes(env, TASK)
    assert sample.reward == 2.0 and sample.reward_components["length"] > 0
    # the function read slime's field names
    assert sample.reward_components["seen"] == f"42|{TASK.prompt}|{TASK.metadata}|COMPLETED|None"


def test_registry_names_every_kind_and_rejects_bad_paths():
    for kind in ("math", "code", "nemo_gym", "openreward", "nemo_rl", "slime_rm"):
        assert issubclass(resolve_kind(kind), Environment), kind
    with pytest.raises(UnknownEnvironmentKind, match="registered"):
        resolve_kind("no.such.module:Env")
    with pytest.raises(UnknownEnvironmentKind, match="not an Environment"):
        resolve_kind("tests.workers.test_env_plugins:NemoRLMath")
    with pytest.raises(ConfigError, match=r"environments\.rm\.options\.function"):
        build_environment("rm", _config("slime_rm", function="tests.workers.test_env_plugins:nope"))


def test_example_config_covers_every_kind_and_loads():
    config = load_config(EXAMPLE_CONFIG)
    kinds = {env.kind for env in config.environments.values()}
    assert {"math", "code", "nemo_gym", "openreward", "nemo_rl", "slime_rm"} <= kinds
    assert any("." in kind for kind in kinds)  # a dotted-path class
    assert set(KINDS) - {"arithmetic", "calculator"} <= kinds
    options_classes = {"math": "MathOptions", "code": "CodeOptions", "nemo_gym": "NemoGymOptions",
                       "openreward": "OpenRewardOptions", "nemo_rl": "NemoRLOptions", "slime_rm": "SlimeRMOptions"}
    for env in config.environments.values():  # every registered kind's options validate
        if env.kind in options_classes:
            module = __import__(KINDS[env.kind].split(":")[0], fromlist=["_"])
            msgspec.convert(env.options, getattr(module, options_classes[env.kind]))
