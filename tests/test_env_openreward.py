"""`openreward`: an environment hosted locally with the SDK's own `Server`, driven through
the SDK client: multi-turn episodes, per-step rewards, every reduction, nonterminal, clamp."""

from __future__ import annotations

import os

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")  # no PyPI lookups from tests

import msgspec
import pytest
from openreward.environments import Environment, TextBlock, ToolOutput, terminal, tool
from pydantic import BaseModel

from pipeline.config import ConfigError, EnvConfig
from pipeline.local_redis import free_port
from pipeline.schema import Status, Task
from workers.envs.base import EnvError, EpisodeRecord, ToolCall
from workers.envs.openreward_env import OpenRewardEnvironment

from tests.env_helpers import run_episodes, serve_openreward

SECRET_VAR = "ROLLOUT_TEST_OR_SECRET"
SEEN_SECRETS: list[str] = []


class Expression(BaseModel):
    expression: str


class Answer(BaseModel):
    answer: str


class Arith(Environment):
    """Evaluate expressions (reward 0.25 per call); the final message is graded by `submit`."""

    def __init__(self, task_spec: dict = {}, secrets: dict = {}):
        super().__init__(task_spec, secrets)
        SEEN_SECRETS.append(secrets.get(SECRET_VAR, ""))

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"question": "What is 6 * 7?", "answer": "42"}, {"question": "What is 2 + 2?", "answer": "4"}]

    def get_prompt(self):
        return [TextBlock(text=self.task_spec["question"])]

    @tool
    async def evaluate(self, params: Expression) -> ToolOutput:
        """Evaluate an arithmetic expression."""
        from workers.envs.local import evaluate_arithmetic

        value = evaluate_arithmetic(params.expression)
        return ToolOutput(blocks=[TextBlock(text=f"{value:g}")], reward=0.25)

    @tool
    async def give_up(self) -> ToolOutput:
        """End the episode without an answer."""
        return ToolOutput(blocks=[TextBlock(text="bye")], reward=-0.5, finished=True)

    @terminal
    @tool
    async def submit(self, params: Answer) -> ToolOutput:
        """Grade the final answer."""
        correct = f"Answer: {self.task_spec['answer']}" in params.answer
        return ToolOutput(blocks=[TextBlock(text="graded")], reward=1.0 if correct else 0.0, finished=True)


@pytest.fixture(scope="module")
def or_server():
    """The SDK's Server app under uvicorn on loopback, in a thread of this process."""
    with serve_openreward(Arith) as url:
        yield url


def _env(url: str, extra_options: dict | None = None, **config) -> OpenRewardEnvironment:
    options = {"environment": "arith", "base_url": url, **(extra_options or {})}
    data = {"kind": "openreward", "options": options, **config}
    return OpenRewardEnvironment("arith", msgspec.convert(data, EnvConfig))


TASK = Task(id="or1", env="arith", prompt="{}", metadata={"task_spec": {"question": "What is 6 * 7?", "answer": "42"}})


@pytest.mark.parametrize(
    "reduction,expected",
    [("sum", 1.25), ("mean", 0.625), ("max", 1.0), ("min", 0.25)],
)
async def test_multi_turn_episode_through_the_runner_with_each_reduction(or_server, reduction, expected):
    env = _env(or_server, reward_reduction=reduction)
    try:
        [sample] = await run_episodes(env, TASK)
    finally:
        await env.aclose()
    # turn 1: the model calls `evaluate` (step reward 0.25); turn 2: "Answer: 42" -> terminal `submit` (1.0)
    assert sample.status is Status.COMPLETED, sample.metadata
    assert sample.metadata["turns"] == 2 and sample.metadata["step_rewards"] == [0.25]
    assert sample.reward_components["rewards"] == [0.25, 1.0] and sample.reward_components["finished"]
    assert sample.reward == pytest.approx(expected)


async def test_session_steps_rewards_nonterminal_and_clamp(or_server, monkeypatch):
    monkeypatch.setenv(SECRET_VAR, "s3cret")
    domains = {"secret_domains": {SECRET_VAR: ["127.0.0.1"]}}
    env = _env(or_server, nonterminal_reward=-1.0, min_reward=-1.2, secrets=[SECRET_VAR], extra_options=domains)
    task = Task(id="or2", env="arith", prompt="{}", metadata={"split": "train", "index": 1})
    session = await env.start(task)
    try:
        assert session.messages[-1]["content"] == "What is 2 + 2?"
        assert {t["function"]["name"] for t in session.tools} == {"evaluate", "give_up"}  # terminal tool hidden
        first = await session.step([ToolCall(id="a", name="evaluate", arguments={"expression": "2+2"})])
        assert first.messages[0]["content"] == "4" and first.reward == 0.25 and not first.done
        second = await session.step(
            [ToolCall(id="b", name="nope", arguments={}), ToolCall(id="c", name="evaluate", arguments={"expression": "1"})]
        )
        assert second.messages[0]["content"].startswith("error:")  # ToolCallError -> observation
        record = EpisodeRecord(task=task, messages=session.messages, response_text="", status=Status.TRUNCATED, turns=2)
        verification = await session.verify(record)  # truncated: no terminal call
        assert verification.components["rewards"] == [0.25, 0.25] and verification.terminal is False
        assert verification.reward == pytest.approx(-0.5)  # 0.25 + 0.25 - 1.0
    finally:
        await session.close()
        await env.aclose()
    assert SEEN_SECRETS[-1] == "s3cret"  # delivered to the environment, not stored in the sample


async def test_finished_by_a_tool_and_calls_after_it(or_server):
    env = _env(or_server, reward_reduction="sum", max_reward=0.0)
    session = await env.start(TASK)
    try:
        result = await session.step(
            [ToolCall(id="a", name="give_up", arguments={}), ToolCall(id="b", name="evaluate", arguments={"expression": "1"})]
        )
        assert result.done and "not run" in result.messages[1]["content"]
        record = EpisodeRecord(task=TASK, messages=session.messages, response_text="", finished=True, status=Status.COMPLETED)
        verification = await session.verify(record)
        assert verification.reward == -0.5 and verification.terminal is True
    finally:
        await session.close()
        await env.aclose()


async def test_unreachable_server_and_bad_config():
    env = _env(f"http://127.0.0.1:{free_port()}", timeouts={"start": {"timeout_s": 2.0, "retries": 1, "backoff_s": 0.01}})
    try:
        with pytest.raises(EnvError, match="create session"):
            await env.start(TASK)
    finally:
        await env.aclose()
    with pytest.raises(ConfigError, match=r"environments\.arith\.options"):
        OpenRewardEnvironment("arith", EnvConfig(kind="openreward", options={"base_url": "x"}))
    with pytest.raises(ConfigError, match="ROLLOUT_TEST_MISSING"):
        _env("http://x", secrets=["ROLLOUT_TEST_MISSING"])
