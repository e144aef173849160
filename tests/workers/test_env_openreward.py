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
from pipeline.schema import Status, Task
from pipeline.store.local_redis import free_port
from tests.support.env_helpers import run_episodes, serve_openreward
from workers.envs.base import EnvError, EpisodeRecord, ToolCall
from workers.envs.openreward_env import OpenRewardEnvironment

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
    """The SDK's Server app under uvicorn on loopback, in a thread of this process, hosting
    every environment of this file (one server: sse-starlette keeps process-wide state bound
    to the first server's event loop, so a second server in another thread breaks streams)."""
    with serve_openreward(Arith, Chat) as url:
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


# ------------------------------------------------------------------ conversations, at-most-once tool calls

import asyncio  # noqa: E402

from openreward.environments.types import Message as OrMessage  # noqa: E402
from openreward.environments.types import ReasoningBlock, ToolCallBlock, ToolResultBlock  # noqa: E402

from tests.support.nemo_gym_support import FaultProxy, serve_proxy  # noqa: E402
from workers.envs import openreward_env  # noqa: E402


class Pair(BaseModel):
    a: int
    b: int


class Chat(Environment):
    """A conversation-shaped environment (`get_messages`); `add` records every run it makes."""

    RUNS: list[tuple[int, int]] = []

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"id": "c0"}, {"id": "c1"}]

    def get_messages(self):
        return [
            OrMessage(role="system", blocks=[TextBlock(text="You add numbers.")]),
            OrMessage(role="user", blocks=[TextBlock(text="Add 2 and 3.")]),
            OrMessage(role="assistant", blocks=[ReasoningBlock(text="Use the tool."), ToolCallBlock(id="tc1", name="add", input={"a": 2, "b": 3})]),
            OrMessage(role="user", blocks=[ToolResultBlock(tool_call_id="tc1", blocks=[TextBlock(text="5")]), TextBlock(text="Now add 5 and 6.")]),
        ]

    @tool
    async def add(self, params: Pair) -> ToolOutput:
        """Add two numbers (slowly when a is 99)."""
        Chat.RUNS.append((params.a, params.b))
        if params.a == 99:
            await asyncio.sleep(2.0)
        return ToolOutput(blocks=[TextBlock(text=str(params.a + params.b))], reward=0.5)

    @tool
    async def finish(self) -> ToolOutput:
        """End the episode."""
        return ToolOutput(blocks=[TextBlock(text="bye")], reward=1.0, finished=True)


@pytest.fixture(scope="module")
def chat_server(or_server):
    return or_server


def _chat(url: str, **config) -> OpenRewardEnvironment:
    data = {"kind": "openreward", "options": {"environment": "chat", "variant": "chat", "base_url": url, "system_prompt": "Be brief."}, **config}
    return OpenRewardEnvironment("chat", msgspec.convert(data, EnvConfig))


CHAT_TASK = Task(id="c0", env="chat", prompt="{}", metadata={"split": "train", "index": 0})
ONE_SHOT = {"step": {"timeout_s": 1.0, "retries": 2, "backoff_s": 0.01}}


async def test_a_conversation_environment_gives_its_messages_not_one_flattened_turn(chat_server):
    env = _chat(chat_server)
    session = await env.start(CHAT_TASK)
    try:
        assert session.messages == [
            {"role": "system", "content": "Be brief.\n\nYou add numbers."},
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
             "tool_calls": [{"id": "tc1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "content": "5", "tool_call_id": "tc1", "name": "add"},
            {"role": "user", "content": "Now add 5 and 6."},
        ]
        from tests.support.env_helpers import chat_tokens

        assert chat_tokens().prompt_ids(session.messages, session.tools)  # the chat template renders it
        result = await session.step([ToolCall(id="a", name="add", arguments={"a": 5, "b": 6})])
        assert result.messages[0]["content"] == "11" and result.reward == 0.5
    finally:
        await session.close()
        await env.aclose()


async def test_a_prompt_environment_still_gives_one_user_turn(or_server):
    env = _env(or_server)
    session = await env.start(TASK)
    try:
        assert session.messages == [{"role": "user", "content": "What is 6 * 7?"}]
    finally:
        await session.close()
        await env.aclose()


async def test_a_slow_tool_is_not_sent_again_and_fails_the_episode(chat_server):
    Chat.RUNS.clear()
    env = _chat(chat_server, timeouts=ONE_SHOT)
    session = await env.start(CHAT_TASK)
    try:
        with pytest.raises(EnvError, match="no answer within 1s; not sent again"):
            await session.step([ToolCall(id="a", name="add", arguments={"a": 99, "b": 1})])
        await asyncio.sleep(1.5)
        assert Chat.RUNS == [(99, 1)]  # ran once: its reward is unknown, so the episode fails
    finally:
        await session.close()
        await env.aclose()


async def test_an_answer_lost_before_its_task_id_is_not_sent_again(chat_server):
    """The server ran the call, the answer never arrived: the SDK is told not to re-POST."""
    Chat.RUNS.clear()
    proxy = FaultProxy.to(chat_server, {"/chat/call": ["lose"]})
    async with serve_proxy(proxy) as url:
        env = _chat(url)
        session = await env.start(CHAT_TASK)
        try:
            with pytest.raises(EnvError, match="tool add"):
                await session.step([ToolCall(id="a", name="add", arguments={"a": 1, "b": 1})])
        finally:
            await session.close()
            await env.aclose()
    assert proxy.seen["/chat/call"] == 1 and Chat.RUNS == [(1, 1)]


async def test_episode_finished_after_a_lost_answer_is_an_environment_failure(chat_server, monkeypatch):
    """With the SDK's own call_tool (which re-POSTs a call whose answer was lost before its
    task id), the re-sent `finish` is refused as "episode finished": not the model's mistake."""
    monkeypatch.setattr(openreward_env, "_RESUMABLE_ONLY", False)
    proxy = FaultProxy.to(chat_server, {"/chat/call": ["lose"]})
    async with serve_proxy(proxy) as url:
        env = _chat(url)
        session = await env.start(CHAT_TASK)
        try:
            with pytest.raises(EnvError, match="an earlier answer was lost"):
                await session.step([ToolCall(id="a", name="finish", arguments={})])
        finally:
            await session.close()
            await env.aclose()
    assert proxy.seen["/chat/call"] == 2


@pytest.mark.parametrize("field,wrong,says", [
    (rb'"reward":\s*0\.5', b'"reward": "high"', "reward 'high' is not a finite number"),
    (rb'"finished":\s*false', b'"finished": "false"', "finished 'false' is not true or false"),
])
async def test_a_wrong_shaped_tool_answer_fails_the_episode_as_the_servers_fault(chat_server, field, wrong, says):
    """The SDK client copies an answer's reward and finished off the wire unchecked: a string
    reward used to reach float() in the episode (a ValueError: our bug, the job failed loudly),
    a string "false" ended the episode. Both are the server's fault: a failed episode with the
    reason, handed back per policy, never counted as a bug."""
    import re

    from workers.envs.answers import MalformedAnswer
    from workers.errors import is_bug

    Chat.RUNS.clear()
    proxy = FaultProxy.to(chat_server, {"/chat/call": [lambda body: re.sub(field, wrong, body)]})
    async with serve_proxy(proxy) as url:
        env = _chat(url)
        session = await env.start(CHAT_TASK)
        try:
            with pytest.raises(MalformedAnswer, match=says) as raised:
                await session.step([ToolCall(id="a", name="add", arguments={"a": 1, "b": 2})])
            assert not is_bug(raised.value) and not session.finished
            result = await session.step([ToolCall(id="b", name="add", arguments={"a": 2, "b": 2})])
            assert result.reward == 0.5 and not result.done  # the next answer, as sent, is fine
        finally:
            await session.close()
            await env.aclose()
    assert Chat.RUNS == [(1, 2), (2, 2)]  # each ran once: nothing sent again


async def test_a_call_that_never_left_is_retried_then_fails_as_unreachable(chat_server):
    proxy = FaultProxy.to(chat_server)
    async with serve_proxy(proxy) as url:
        env = _chat(url, timeouts=ONE_SHOT)
        session = await env.start(CHAT_TASK)
    try:  # the proxy is gone: connections are refused, nothing was sent
        with pytest.raises(EnvError, match=r"not sent after 3 attempt\(s\)"):
            await session.step([ToolCall(id="a", name="add", arguments={"a": 1, "b": 2})])
    finally:
        await session.close()
        await env.aclose()


def test_duplicate_task_ids_across_two_openreward_environments_fail_prepare(or_server, tmp_path):
    from pipeline.config import PipelineConfig
    from producers.prepare_tasks import PrepareError, prepare_tasks

    def environment(variant: str) -> dict:
        return {"kind": "openreward", "options": {"environment": "arith", "base_url": or_server}, "dataset": {"source": "openreward", "fields": {"id": "task_spec.question"}}}

    config = msgspec.convert({"environments": {"a": environment("a"), "b": environment("b")}}, PipelineConfig)
    with pytest.raises(PrepareError, match=r"duplicate task id 'What is 6 \* 7\?' \(first at openreward:arith/train#0\) of environment 'a'"):
        prepare_tasks(config, tmp_path / "tasks.jsonl")
    assert not (tmp_path / "tasks.jsonl").exists()


async def test_the_terminal_tool_gets_the_answer_not_the_reasoning(or_server):
    env = _env(or_server)
    session = await env.start(TASK)
    try:
        final = {"role": "assistant", "content": "<think>Answer: 42 would be too easy.</think>Answer: 41"}
        record = EpisodeRecord(task=TASK, messages=[*session.messages, final], response_text="", status=Status.COMPLETED)
        verification = await session.verify(record)
        assert verification.components["rewards"] == [0.0] and verification.terminal is True
    finally:
        await session.close()
        await env.aclose()
